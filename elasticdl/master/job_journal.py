"""The job core's side of master failover: journaling its transitions, snapshots,
and restoring from them (see :mod:`elasticdl.master.journal`).

:class:`Journaled` is a mixin of :class:`~elasticdl.master.job.JobCore`: every
public state change calls :meth:`_log` under the core's lock; a replay runs the
same public calls with the journaled clock, so it decides exactly as the dead
master did.
"""

from __future__ import annotations

import base64
import contextlib
import enum
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Optional

from elasticdl.common.intervals import IntervalSet
from elasticdl.common.task import Task, TaskType
from elasticdl.master import task_state
from elasticdl.master.journal import Journal, JournalError

if TYPE_CHECKING:
    from elasticdl.master.replicas import ReplicaBook
    from elasticdl.master.task_manager import TaskManager

logger = logging.getLogger("elasticdl.master.job")

Metric = tuple[str, float, int]


class Journaled:
    """Journal state for the job core (mixed into JobCore, which sets it up with
    :meth:`_init_journal`)."""

    tm: TaskManager
    replicas: ReplicaBook
    _lock: threading.RLock

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

    if TYPE_CHECKING:  # the public calls a replay runs (JobCore has them)
        def state_dict(self, defer: bool = False) -> dict[str, Any]:
            ...

        def load_state_dict(self, state: dict[str, Any]) -> None:
            ...

        def get(self, worker_id: int, task_type: Optional[TaskType] = None,
                request_id: int = 0) -> Task:
            ...

        def report_task(self, task_id: int, worker_id: int, success: bool, error: str = "",
                        traceback: str = "", fatal: bool = False, counters: Any = None,
                        model_version: Optional[int] = None, loss: Optional[float] = None,
                        learning_rate: Optional[float] = None) -> None:
            ...

        def report_evaluation(self, task_id: int, model_version: int, metrics: Any,
                              states: bytes = b"") -> None:
            ...

        def on_version(self, worker_id: int, version: int) -> None:
            ...

        def begin(self) -> None:
            ...

        def recover_tasks(self, worker_id: int) -> list[Task]:
            ...

        def rollback(self, applied: dict[int, int], new_version: int,
                     closed: Optional[IntervalSet] = None) -> list[int]:
            ...

        def settle(self, checkpoint_version: int, held: IntervalSet) -> int:
            ...

        def begin_rollback(self) -> None:
            ...

        def end_rollback(self) -> None:
            ...

        def start_at_version(self, version: int) -> None:
            ...

        def claim_export(self, worker_id: int) -> bool:
            ...

        def worker_reported(self, worker_id: int, message: str, traceback: str) -> None:
            ...

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
        :data:`HANDLERS`)."""
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
        try:
            op = Op(rec["op"])
        except ValueError:
            raise JournalError(f"journal record {rec.get('seq')}: unknown op "
                               f"{rec['op']!r}") from None
        with self._at(rec.get("t")):
            HANDLERS[op](self, rec)


class Op(str, enum.Enum):
    """The journal's record kinds: one per journaled JobCore transition. A new
    transition adds a member here and its replay in :data:`HANDLERS`."""

    GET = "get"
    REPORT = "report"
    LEASE = "lease"                     # several gets of one call (get_tasks)
    REPORTS = "reports"                 # several reports of one call
    METRICS = "metrics"
    VERSION = "version"
    BEGIN = "begin"
    RECOVER = "recover"
    ROLLBACK = "rollback"
    SETTLE = "settle"
    BEGIN_ROLLBACK = "begin_rollback"   # journals written before the rollback protocol
    END_ROLLBACK = "end_rollback"
    START_AT = "start_at"
    EXPORT = "export"
    WORKER_REPORTED = "worker_reported"
    # recovery protocols and replica identities (elasticdl.master.recovery)
    INCARNATION = "incarnation"
    PS_LOST = "ps_lost"
    PROTOCOL_STEP = "protocol_step"
    ROLLBACK_REQUEUED = "rollback_requeued"
    PROTOCOL_CLOSE = "protocol_close"
    EXPORT_WRITTEN = "export_written"
    EXPORT_LOST = "export_lost"
    EXPORT_OPEN = "export_open"
    LAUNCH = "launch"
    GONE = "gone"
    NOTE_EXIT = "note_exit"
    RESIZE = "resize"                   # elasticdl scale: new worker bounds (scaling.py)


def _replay_get(core: Any, rec: dict[str, Any]) -> None:
    tt = rec["type"]
    task = core.get(rec["w"], None if tt is None else TaskType(tt), rec["r"])
    got = task_state.task_to_json(task)
    if got != rec["task"]:
        raise JournalError(f"journal record {rec['seq']}: replayed get_task gave "
                           f"task {got}, the journal says {rec['task']}")


def _replay_lease(core: Any, rec: dict[str, Any]) -> None:
    tt = rec["type"]
    with core._lock:
        for i, want in enumerate(rec["tasks"]):
            got = task_state.task_to_json(core._get_locked(
                rec["w"], None if tt is None else TaskType(tt), reassign=i == 0))
            if got != want:
                raise JournalError(f"journal record {rec['seq']}: replayed get_tasks gave "
                                   f"task {got}, the journal says {want}")


def _replay_reports(core: Any, rec: dict[str, Any]) -> None:
    from elasticdl.master.job import TaskResult

    refused = core.report_tasks(rec["w"], [TaskResult(*r) for r in rec["results"]])
    if refused:
        raise JournalError(f"journal record {rec['seq']}: replayed reports refused "
                           f"{refused}, the journal recorded them all")


def _replay_launch(core: Any, rec: dict[str, Any]) -> None:
    got = core.launch_worker(rec["lineage"])
    if got != rec["id"]:
        raise JournalError(f"journal record {rec['seq']}: replayed launch gave worker "
                           f"{got}, the journal says {rec['id']}")


def _replay_step(core: Any, rec: dict[str, Any]) -> None:
    from elasticdl.master.protocols import Step

    core.protocol_step(rec["pid"], Step(rec["step"]), **rec["data"])


Handler = Callable[[Any, dict[str, Any]], None]

HANDLERS: dict[Op, Handler] = {
    Op.GET: _replay_get,
    Op.LEASE: _replay_lease,
    Op.REPORTS: _replay_reports,
    Op.REPORT: lambda core, rec: core.report_task(
        rec["task"], rec["w"], rec["ok"], rec["error"], rec["tb"], rec["fatal"],
        rec["counters"], rec["version"], rec.get("loss"), rec.get("lr")),
    Op.METRICS: lambda core, rec: core.report_evaluation(
        rec["task"], rec["version"], [tuple(m) for m in rec["metrics"]],
        base64.b64decode(rec.get("states", ""))),
    Op.VERSION: lambda core, rec: core.on_version(rec["w"], rec["version"]),
    Op.BEGIN: lambda core, rec: core.begin(),
    Op.RECOVER: lambda core, rec: core.recover_tasks(rec["w"]),
    Op.ROLLBACK: lambda core, rec: core.rollback(
        {int(k): v for k, v in rec["applied"].items()}, rec["version"],
        None if rec.get("closed") is None else IntervalSet.from_flat(rec["closed"])),
    Op.SETTLE: lambda core, rec: core.settle(rec["version"],
                                             IntervalSet.from_flat(rec["held"])),
    Op.BEGIN_ROLLBACK: lambda core, rec: core.begin_rollback(),
    Op.END_ROLLBACK: lambda core, rec: core.end_rollback(),
    Op.START_AT: lambda core, rec: core.start_at_version(rec["version"]),
    Op.EXPORT: lambda core, rec: core.claim_export(rec["w"]),
    Op.WORKER_REPORTED: lambda core, rec: core.worker_reported(rec["w"], rec["error"],
                                                               rec["tb"]),
    Op.INCARNATION: lambda core, rec: core.new_incarnation(),
    Op.PS_LOST: lambda core, rec: core.ps_lost(rec["index"], rec["source"], rec["now"]),
    Op.PROTOCOL_STEP: _replay_step,
    Op.ROLLBACK_REQUEUED: lambda core, rec: core.rollback_requeued(
        rec["pid"], {int(k): v for k, v in rec["applied"].items()}, rec["version"],
        None if rec.get("closed") is None else IntervalSet.from_flat(rec["closed"])),
    Op.PROTOCOL_CLOSE: lambda core, rec: core.protocol_close(rec["pid"]),
    Op.EXPORT_WRITTEN: lambda core, rec: core.export_written(rec["w"], rec["path"]),
    Op.EXPORT_LOST: lambda core, rec: core.export_lost(rec["pid"]),
    Op.EXPORT_OPEN: lambda core, rec: core.open_export(rec["source"]),
    Op.LAUNCH: _replay_launch,
    Op.GONE: lambda core, rec: core.replica_gone(rec["w"], rec["ok"], rec["key"],
                                                 rec["counts"]),
    Op.NOTE_EXIT: lambda core, rec: core.note_exit(rec["w"], rec["replica"], rec["fallback"]),
    Op.RESIZE: lambda core, rec: core.resize_workers(rec["min"], rec["max"], rec["reason"]),
}
