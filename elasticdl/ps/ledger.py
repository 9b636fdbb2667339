"""The applied-identity ledger of one PS: which pushes it applied, in order.

Every training push carries its identity ``(task_id, minibatch)`` and its
record count. A PS applies an identity at most once: a push whose identity is
already in the ledger (a re-issued task, a retried RPC, a straggler's copy) is
answered ``duplicate`` and changes nothing. The ledger is part of the PS's
checkpoint, so after a restore it says exactly which gradients the restored
parameters contain; the master (from the ``rollback`` answer) and the workers
(``applied`` RPC) read it to re-run exactly the work after that point (see
docs/parameter_server.md).

The log is append-only (``task, minibatch, records, version`` per applied
push, 32 bytes each), so a duplicate application would be visible in it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from typing import Any, Optional

Identity = tuple[int, int]


class AppliedLedger:
    """Identities applied on this PS (thread safety: the shard's lock)."""

    def __init__(self) -> None:
        self._by_task: dict[int, dict[int, int]] = {}
        self._log = array("q")

    def __len__(self) -> int:
        return len(self._log) // 4

    def seen(self, task_id: int, minibatch: int) -> bool:
        return minibatch in self._by_task.get(task_id, ())

    def add(self, task_id: int, minibatch: int, records: int, version: int) -> None:
        self._by_task.setdefault(task_id, {})[minibatch] = records
        self._log.extend((task_id, minibatch, records, version))

    def entries(self, task_ids: Optional[Iterable[int]] = None
                ) -> Iterator[tuple[int, int, int, int]]:
        """``(task, minibatch, records, version)`` in application order."""
        wanted = None if task_ids is None else set(task_ids)
        log = self._log
        for i in range(0, len(log), 4):
            if wanted is None or log[i] in wanted:
                yield log[i], log[i + 1], log[i + 2], log[i + 3]

    def state_dict(self) -> dict[str, Any]:
        import torch  # the master reads ledgers (read_json) and never imports torch

        return {"log": torch.tensor(self._log.tolist(), dtype=torch.int64).reshape(-1, 4)}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        self._by_task = {}
        self._log = array("q")
        if state is None:
            return
        for task, mb, records, version in state["log"].tolist():
            self.add(task, mb, records, version)

