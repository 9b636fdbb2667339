"""The applied-identity ledger of one PS: which pushes it applied.

Every training push carries its identity ``(task_id, minibatch)`` and its
record count. A PS applies an identity at most once: a push whose identity is
already in the ledger (a re-issued task, a retried RPC, a straggler's copy) is
answered ``duplicate`` and changes nothing. The ledger is part of the PS's
checkpoint, so after a restore it says exactly which gradients the restored
parameters contain; the master (from the ``rollback`` answer) and the workers
(``applied`` RPC) read it to re-run exactly the work after that point (see
docs/parameter_server.md). Here, below the PS, because the master's PS rollback and the
PS checkpoint files read ledgers too.

Sized by the live state, not the job's history (docs/scale.md): the ledger
holds

* ``closed``: an :class:`~elasticdl.common.intervals.IntervalSet` of the tasks
  the master counted done (told by its ``settle`` messages). Every minibatch
  of a closed task is held; a push of one is a duplicate. O(holes).
* the *live* entries ``(task, minibatch) -> (records, version)`` of tasks not
  closed, in application order: O(tasks in flight + done since the last
  settle).

``generation`` is the master's rollback version this PS last rolled back to
(-1: never). A ``settle`` of an older generation is ignored, so a task that a
rollback re-opened is never closed again by a message sent before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Optional

from elasticdl.common.intervals import IntervalSet

Identity = tuple[int, int]
Entry = tuple[int, int, int, int]   # task, minibatch, records, version


class AppliedLedger:
    """Identities applied on this PS (thread safety: the shard's lock)."""

    def __init__(self) -> None:
        self.closed = IntervalSet()
        self.generation = -1
        self.applied_total = 0   # identified pushes ever applied (a counter, for status)
        self._live: dict[Identity, tuple[int, int]] = {}   # application order
        self._by_task: dict[int, dict[int, int]] = {}      # task -> {minibatch: records}

    def __len__(self) -> int:
        """Live entries (pushes of tasks not closed)."""
        return len(self._live)

    def seen(self, task_id: int, minibatch: int) -> bool:
        return (task_id, minibatch) in self._live or task_id in self.closed

    def add(self, task_id: int, minibatch: int, records: int, version: int) -> None:
        self.applied_total += 1
        if task_id in self.closed:   # cannot happen (seen first): nothing to keep
            return
        self._by_task.setdefault(task_id, {})[minibatch] = records
        self._live[(task_id, minibatch)] = (records, version)

    def entries(self, task_ids: Optional[Iterable[int]] = None) -> Iterator[Entry]:
        """Live ``(task, minibatch, records, version)`` in application order (of
        ``task_ids`` only: O(their entries))."""
        if task_ids is None:
            for (task, mb), (records, version) in self._live.items():
                yield task, mb, records, version
            return
        rows: list[Entry] = []
        for task in dict.fromkeys(task_ids):
            for mb in self._by_task.get(task, ()):
                records, version = self._live[(task, mb)]
                rows.append((task, mb, records, version))
        rows.sort(key=lambda r: r[3])   # stable: application order
        yield from rows

    def closed_of(self, task_ids: Optional[Iterable[int]] = None) -> IntervalSet:
        """The closed set (restricted to ``task_ids``)."""
        if task_ids is None:
            return self.closed.copy()
        return IntervalSet((t, t + 1) for t in task_ids if t in self.closed)

    # ------------------------------------------------------------- settle
    def settle(self, generation: int, closed: IntervalSet) -> Optional[int]:
        """Fold the live entries of ``closed`` tasks into the closed set; returns the
        number of live entries folded, or None when ``generation`` is older than
        this ledger's (a message sent before a rollback: ignored)."""
        if generation < self.generation:
            return None
        self.generation = generation
        if not closed:
            return 0
        self.closed = self.closed.union(closed)
        folded = 0
        for task in [t for t in self._by_task if t in self.closed]:
            for mb in self._by_task.pop(task):
                del self._live[(task, mb)]
                folded += 1
        return folded

    # ------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        import torch  # the master reads ledgers (read_json) and never imports torch

        rows = [(t, mb, r, v) for (t, mb), (r, v) in self._live.items()]
        return {"log": torch.tensor(rows, dtype=torch.int64).reshape(-1, 4),
                "closed": torch.tensor(self.closed.to_flat(), dtype=torch.int64),
                "applied_total": self.applied_total, "generation": self.generation}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """Load a checkpointed ledger (one written before compaction: a full log and
        no closed set). The generation is not part of it: a rollback sets it."""
        self.closed = IntervalSet()
        self._live = {}
        self._by_task = {}
        self.applied_total = 0
        if state is None:
            return
        if state.get("closed") is not None:
            self.closed = IntervalSet.from_flat([int(x) for x in state["closed"].tolist()])
        for task, mb, records, version in state["log"].tolist():
            self.add(task, mb, records, version)
        self.applied_total = int(state.get("applied_total", self.applied_total))


def held(closed: IntervalSet, entries: Iterable[tuple[int, int, int]]
         ) -> tuple[IntervalSet, dict[int, dict[int, int]]]:
    """``(closed, task -> {minibatch: records})`` of one ledger (helper for the
    intersections below)."""
    live: dict[int, dict[int, int]] = {}
    for task, mb, records in entries:
        if task not in closed:
            live.setdefault(task, {})[mb] = records
    return closed, live


def common(ledgers: list[tuple[IntervalSet, dict[int, dict[int, int]]]]
           ) -> tuple[IntervalSet, dict[int, dict[int, int]]]:
    """What *every* ledger holds: tasks closed on all of them, and per other task
    the minibatches each ledger holds (live, or its task closed there) with their
    records. O(live + closed intervals)."""
    if not ledgers:
        return IntervalSet(), {}
    closed = ledgers[0][0]
    for c, _ in ledgers[1:]:
        closed = closed.intersection(c)
    out: dict[int, dict[int, int]] = {}
    tasks = set().union(*(live for _, live in ledgers))
    for task in tasks:
        if task in closed:
            continue
        mbs: Optional[dict[int, int]] = None
        for c, live in ledgers:
            if task in c:
                continue   # every minibatch held
            mine = live.get(task, {})
            mbs = dict(mine) if mbs is None else {m: r for m, r in mbs.items() if m in mine}
        if mbs:
            out[task] = mbs
    return closed, out
