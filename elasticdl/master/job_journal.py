"""The job core's side of master failover: journaling its transitions, snapshots,
and restoring from them (see :mod:`elasticdl.master.journal`).

:class:`Journaled` is a mixin of the job core (see
:mod:`elasticdl.master.core_base` for the rule its parts share): every public
state change calls :meth:`_log` under the core's lock; a replay runs the same
public calls with the journaled clock (:mod:`elasticdl.master.job_replay`,
keyed by :class:`~elasticdl.master.journal_ops.Op`), so it decides exactly as
the dead master did.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional, cast

from elasticdl.master import task_state
from elasticdl.master.core_base import CoreBase
from elasticdl.master.job_replay import ReplayTarget, replay
from elasticdl.master.journal import Journal, JournalError
from elasticdl.master.journal_ops import Op
from elasticdl.master.task_manager import TaskManager

logger = logging.getLogger("elasticdl.master.job")


class Journaled(CoreBase):
    """Journal state for the job core (mixed into JobCore, which sets it up with
    :meth:`_init_journal`)."""

    def _init_journal(self, task_manager: TaskManager) -> None:
        # the write-ahead journal (master failover): every public state change is
        # recorded, with the clock it saw, before the call returns
        self._journal: Optional[Journal] = None
        # state of collaborators snapshotted with the core (the rendezvous): name ->
        # an object with state_dict(); what a restore found is in restored_extra
        self.attachments: dict[str, Any] = {}
        self.restored_extra: dict[str, Any] = {}
        self.group_commit = False
        self._replaying = False
        # how long snapshots held the core's lock (the last one, the longest; wall
        # time, and the CPU time of the snapshotting thread meanwhile)
        self.snapshot_lock_s = self.max_snapshot_lock_s = self.max_snapshot_lock_cpu_s = 0.0
        self._frozen: Optional[float] = None
        self._base_clock: Callable[[], float] = task_manager._clock
        task_manager._clock = self._now

    def _now(self) -> float:
        return self._frozen if self._frozen is not None else self._base_clock()

    @contextlib.contextmanager
    def _at(self, t: Optional[float] = None) -> Iterator[float]:
        """One call sees one time (journaled with it, so a replay decides alike)."""
        if self._frozen is not None:  # nested, or replaying: the outer time holds
            yield self._frozen
            return
        self._frozen = self._base_clock() if t is None else t
        try:
            yield self._frozen
        finally:
            self._frozen = None

    def _log(self, op: str, **fields: Any) -> None:
        """Journal transition ``op`` (an :class:`Op` value; its replay is in
        :data:`elasticdl.master.job_replay.HANDLERS`)."""
        if self._journal is not None and not self._replaying:
            # on disk before the call returns: fsynced here (callers that ack
            # over the wire may group-commit instead: see durable())
            self._journal.append({"op": Op(op).value, **fields}, sync=not self.group_commit)

    def durable(self) -> None:
        """Every transition so far is on disk (the servicer calls it before each
        reply; with ``group_commit`` one fsync covers concurrent calls)."""
        if self._journal is not None:
            self._journal.sync()

    def deferred_writes(self) -> contextlib.AbstractContextManager[None]:
        """Within it, this thread's journal records are written at :meth:`durable`
        (one write per RPC, not per record); the caller calls it before replying."""
        journal = self._journal
        return journal.deferred() if journal is not None else contextlib.nullcontext()

    def attach_journal(self, journal: Journal) -> None:
        """Journal every transition from now on (restore first, if continuing)."""
        with self._lock:
            self._journal = journal

    def snapshot(self) -> None:
        """Write the whole state to the journal's snapshot (then its older
        segments go). Call after changes made outside the journaled calls (replica
        bookkeeping, the report) and now and then to keep replays short.

        Only the capture holds the core's lock: the state is O(live) (closed
        work is intervals and counters) and copied into fresh dicts, so
        serialising and writing it happen outside the lock."""
        journal = self._journal
        if journal is None:
            return
        with journal.snapshot_lock:
            collecting = gc.isenabled()
            with self._lock:
                gc.disable()   # no collection of the whole heap while the lock is held
                try:
                    began, began_cpu = time.perf_counter(), time.thread_time()
                    state, extra = self.state_dict(defer=True), self._volatile_state(True)
                    seq = journal.rotate()
                    held, cpu = time.perf_counter() - began, time.thread_time() - began_cpu
                finally:
                    if collecting:
                        gc.enable()
            self.snapshot_lock_s = held
            self.max_snapshot_lock_s = max(self.max_snapshot_lock_s, held)
            self.max_snapshot_lock_cpu_s = max(self.max_snapshot_lock_cpu_s, cpu)
            journal.write_snapshot(seq, task_state.resolve(state), task_state.resolve(extra))

    def _volatile_state(self, defer: bool = False) -> dict[str, Any]:
        """What :meth:`state_dict` leaves out but a replay needs to decide alike:
        when each held task went out, each worker's last get_task request."""
        tm = self.tm
        with tm._lock:
            started = [(k, d.started) for k, d in tm._doing.items()]
            last_get = list(tm._last_get.items())
            state = {"started": task_state.Deferred(lambda: {str(k): t for k, t in started}),
                     "last_get": task_state.Deferred(lambda: {
                         str(w): [r, task_state.task_to_json(t)] for w, (r, t) in last_get}),
                     **{name: a.state_dict() for name, a in self.attachments.items()}}
        return state if defer else task_state.resolve(state)

    def restore(self, journal: Journal) -> int:
        """Continue from ``journal`` (its snapshot, then its records replayed) and
        journal to it from now on; the number of records replayed. Raises
        JournalError when a replay does not decide as the journaled call did."""
        snap, records = journal.load_once()
        with self._lock:
            if snap is not None:
                self.load_state_dict(snap["state"])
                tm, extra = self.tm, snap["extra"]
                self.restored_extra = extra
                for name, attached in self.attachments.items():  # attached before restore
                    if name in extra:
                        attached.load_state_dict(extra[name])
                for k, started in extra["started"].items():
                    if int(k) in tm._doing:
                        tm._doing[int(k)].started = float(started)
                tm._last_get = {int(w): (int(r), task_state.task_from_json(t))
                                for w, (r, t) in extra["last_get"].items()}
            self._replaying = True
            try:
                for rec in records:
                    try:
                        self._apply(rec)
                    except (KeyError, ValueError, TypeError) as e:
                        raise JournalError(f"journal record {rec.get('seq')} ({rec}) cannot "
                                           f"be replayed: {type(e).__name__}: {e}") from e
            finally:
                self._replaying = False
            self._journal = journal
        logger.info("restored the job core: snapshot %s + %d journal record(s)",
                    snap["seq"] if snap else "none", len(records))
        return len(records)

    def _apply(self, rec: dict[str, Any]) -> None:
        with self._at(rec.get("t")):
            replay(cast(ReplayTarget, self), rec)
