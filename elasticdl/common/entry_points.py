"""The processes of a job and the module each one runs (``python -m <module>``).

One table, typed: a process is launched by another (the client starts the master, the
master's job controller the PS and the workers, a Kubernetes pod runs the master), often in
another image, so it is named by its module, not imported; the launcher must not import the
package it starts (the master never imports the worker's torch code). Every launcher takes
its command from here; ``tests/unit/common/test_entry_points.py`` checks that each names a
module with a ``main``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EntryPoint:
    """A process kind of a job and the module it runs."""

    name: str
    module: str

    def argv(self, python: str = "python") -> list[str]:
        """``[python, "-m", module]``: the command before the process's own flags."""
        return [python, "-m", self.module]


MASTER = EntryPoint("master", "elasticdl.master.main")
PS = EntryPoint("ps", "elasticdl.ps.main")
WORKER = EntryPoint("worker", "elasticdl.worker.main")

ALL = (MASTER, PS, WORKER)
