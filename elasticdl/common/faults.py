"""Named fault points: a process SIGKILLs itself at a named point of a recovery
protocol, so a combination of faults is a deterministic test, not a race.

``ELASTICDL_FAULT_POINTS`` lists ``ROLE:POINT[@N]`` entries, comma-separated.
ROLE is ``master``, ``ps`` (any PS), ``ps-1``, ``worker`` (any worker),
``worker-2`` or ``exporter`` (the worker exporting the final model); POINT
names a :func:`point` call; ``@N`` fires on the N-th time this process reaches
it (default: the first). Each entry fires once per job: the first process to
fire it leaves a marker in ``ELASTICDL_FAULT_DIR`` (required with points), so
the process relaunched in its place, which inherits the environment, goes on.
Processes inherit both variables (a local job) or get them with ``--envs``.

Points (grep ``faults.point``): master ``before_start``, ``after_launch_intent``,
``after_relaunch``, ``after_ps_launched``, ``after_rollback_start``,
``after_ps_rollback``, ``after_requeue``, ``after_export_claim`` (a worker
named the exporter, journaled, the order not yet sent), ``after_export_written``
(the export's report journaled, not yet answered); ps ``after_version`` (each model
version it makes), ``after_restore`` (inside the rollback RPC, before it
answers); worker / exporter
``before_export``, ``after_export`` (written, not yet reported).
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Optional

logger = logging.getLogger(__name__)

POINTS_ENV = "ELASTICDL_FAULT_POINTS"
DIR_ENV = "ELASTICDL_FAULT_DIR"

_role: list[str] = []
_hits: dict[str, int] = {}


class FaultSpecError(ValueError):
    """``ELASTICDL_FAULT_POINTS`` is malformed or has no ``ELASTICDL_FAULT_DIR``."""


def set_role(role: str) -> None:
    """This process's replica name (``master``, ``ps-0``, ``worker-3``); mains call it."""
    _role[:] = [role]


def parse(text: str) -> list[tuple[str, str, int]]:
    """``ROLE:POINT[@N],...`` -> [(role, point, n)]."""
    out = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        role, sep, rest = entry.partition(":")
        point, _, n = rest.partition("@")
        if not sep or not role or not point or (n and not n.isdigit()):
            raise FaultSpecError(f"{POINTS_ENV}: {entry!r} is not ROLE:POINT[@N]")
        out.append((role, point, int(n or 1)))
    return out


def _matches(role: str, mine: str, exporting: bool) -> bool:
    if role == mine:
        return True
    if role == "exporter":
        return exporting
    return "-" not in role and mine.split("-")[0] == role


def armed(name: str, *, exporting: bool = False) -> bool:
    """Whether the next :func:`point` ``name`` of this process would die (its entry may
    still have fired already in an earlier process of the job)."""
    text = os.environ.get(POINTS_ENV, "")
    if not text or not _role:
        return False
    hits = _hits.get(name, 0) + 1
    return any(pt == name and n == hits and _matches(role, _role[0], exporting)
               for role, pt, n in parse(text))


def point(name: str, *, exporting: bool = False) -> None:
    """Die here (SIGKILL, as ``kill -9``) when this process's role and ``name`` are
    listed and that entry has not fired in this job yet."""
    text = os.environ.get(POINTS_ENV, "")
    if not text or not _role:
        return
    hits = _hits[name] = _hits.get(name, 0) + 1
    for role, pt, n in parse(text):
        if pt != name or n != hits or not _matches(role, _role[0], exporting):
            continue
        if not _claim(f"{role}:{pt}@{n}"):
            continue
        logger.warning("fault point %s:%s reached (%s): killing this process", role, pt,
                       _role[0])
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _claim(entry: str) -> bool:
    directory: Optional[str] = os.environ.get(DIR_ENV)
    if not directory:
        raise FaultSpecError(f"{POINTS_ENV} needs {DIR_ENV} (where fired points are marked)")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, entry.replace(":", "_").replace("/", "_") + ".fired")
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def fired(directory: str) -> list[str]:
    """The entries fired so far (tests)."""
    if not os.path.isdir(directory):
        return []
    return sorted(n[:-len(".fired")] for n in os.listdir(directory) if n.endswith(".fired"))
