"""The journal's replay table: for each :class:`~elasticdl.master.journal_ops.Op`,
how a restore runs its record again.

A replay makes the same public call of the job core the record was written
by (with the journaled clock: see
:meth:`~elasticdl.master.job_journal.Journaled.restore`), and where the call
decided something (a task handed out, a worker id) checks it decided as the
journal says: a divergent decision raises :class:`JournalError`. The core is
reached through :class:`ReplayTarget` (the calls replayed), never imported.
"""

from __future__ import annotations

import base64
import threading
from typing import Any, Callable, Optional, Protocol

from elasticdl.common.intervals import IntervalSet
from elasticdl.common.task import Task, TaskType
from elasticdl.master import task_state
from elasticdl.master.core_types import Metric, Refusal, TaskResult
from elasticdl.master.journal import JournalError
from elasticdl.master.journal_ops import Op
from elasticdl.master.protocols import Protocol as RecoveryProtocol
from elasticdl.master.protocols import Step

Record = dict[str, Any]


class ReplayTarget(Protocol):
    """The job core's calls a replay runs (``JobCore`` has them all)."""

    _lock: threading.RLock

    def get(self, worker_id: int, task_type: Optional[TaskType] = None,
            request_id: int = 0) -> Task: ...

    def _get_locked(self, worker_id: int, task_type: Optional[TaskType],
                    request_id: int = 0, reassign: bool = True) -> Task: ...

    def report_task(self, task_id: int, worker_id: int, success: bool, error: str = "",
                    traceback: str = "", fatal: bool = False, counters: Any = None,
                    model_version: Optional[int] = None, loss: Optional[float] = None,
                    learning_rate: Optional[float] = None) -> None: ...

    def report_tasks(self, worker_id: int, results: Any) -> list[Refusal]: ...

    def report_evaluation(self, task_id: int, model_version: int, metrics: list[Metric],
                          states: bytes = b"") -> None: ...

    def on_version(self, worker_id: int, version: int) -> None: ...

    def begin(self) -> None: ...

    def recover_tasks(self, worker_id: int) -> list[Task]: ...

    def rollback(self, applied: dict[int, int], new_version: int,
                 closed: Optional[IntervalSet] = None) -> list[int]: ...

    def settle(self, checkpoint_version: int, held: IntervalSet) -> int: ...

    def begin_rollback(self) -> None: ...

    def end_rollback(self) -> None: ...

    def start_at_version(self, version: int) -> None: ...

    def claim_export(self, worker_id: int) -> bool: ...

    def worker_reported(self, worker_id: int, message: str, traceback: str) -> None: ...

    def new_incarnation(self) -> int: ...

    def ps_lost(self, index: int, source: Optional[dict[str, Any]], now: float
                ) -> Optional[RecoveryProtocol]: ...

    def protocol_step(self, pid: int, step: Step, **data: Any) -> RecoveryProtocol: ...

    def rollback_requeued(self, pid: int, applied: dict[int, int], new_version: int,
                          closed: Optional[IntervalSet] = None) -> list[int]: ...

    def protocol_close(self, pid: int) -> None: ...

    def export_written(self, worker_id: int, path: str) -> bool: ...

    def export_lost(self, pid: int) -> None: ...

    def open_export(self, source: Optional[str]) -> None: ...

    def launch_worker(self, lineage: Optional[int] = None) -> int: ...

    def replica_gone(self, worker_id: Optional[int], succeeded: bool, key: str,
                     counts: bool) -> int: ...

    def note_exit(self, worker_id: int, replica: str, fallback: str) -> None: ...

    def resize_workers(self, low: int, high: int, reason: str) -> dict[str, Any]: ...

    def restart_health(self) -> None: ...

    def divergence_rollback(self, source: dict[str, Any], now: float
                            ) -> Optional[RecoveryProtocol]: ...


Handler = Callable[[ReplayTarget, Record], Any]


def _replay_get(core: ReplayTarget, rec: Record) -> None:
    tt = rec["type"]
    task = core.get(rec["w"], None if tt is None else TaskType(tt), rec["r"])
    got = task_state.task_to_json(task)
    if got != rec["task"]:
        raise JournalError(f"journal record {rec['seq']}: replayed get_task gave "
                           f"task {got}, the journal says {rec['task']}")


def _replay_lease(core: ReplayTarget, rec: Record) -> None:
    tt = rec["type"]
    with core._lock:
        for i, want in enumerate(rec["tasks"]):
            got = task_state.task_to_json(core._get_locked(
                rec["w"], None if tt is None else TaskType(tt), reassign=i == 0))
            if got != want:
                raise JournalError(f"journal record {rec['seq']}: replayed get_tasks gave "
                                   f"task {got}, the journal says {want}")


def _replay_reports(core: ReplayTarget, rec: Record) -> None:
    refused = core.report_tasks(rec["w"], [TaskResult(*r) for r in rec["results"]])
    if refused:
        raise JournalError(f"journal record {rec['seq']}: replayed reports refused "
                           f"{refused}, the journal recorded them all")


def _replay_launch(core: ReplayTarget, rec: Record) -> None:
    got = core.launch_worker(rec["lineage"])
    if got != rec["id"]:
        raise JournalError(f"journal record {rec['seq']}: replayed launch gave worker "
                           f"{got}, the journal says {rec['id']}")


def _closed(rec: Record) -> Optional[IntervalSet]:
    return None if rec.get("closed") is None else IntervalSet.from_flat(rec["closed"])


def _applied(rec: Record) -> dict[int, int]:
    return {int(k): v for k, v in rec["applied"].items()}


HANDLERS: dict[Op, Handler] = {
    Op.GET: _replay_get,
    Op.LEASE: _replay_lease,
    Op.REPORTS: _replay_reports,
    Op.REPORT: lambda core, rec: core.report_task(
        rec["task"], rec["w"], rec["ok"], rec["error"], rec["tb"], rec["fatal"],
        rec["counters"], rec["version"], rec.get("loss"), rec.get("lr")),
    Op.METRICS: lambda core, rec: core.report_evaluation(
        rec["task"], rec["version"], [(m[0], m[1], m[2]) for m in rec["metrics"]],
        base64.b64decode(rec.get("states", ""))),
    Op.VERSION: lambda core, rec: core.on_version(rec["w"], rec["version"]),
    Op.BEGIN: lambda core, rec: core.begin(),
    Op.RECOVER: lambda core, rec: core.recover_tasks(rec["w"]),
    Op.ROLLBACK: lambda core, rec: core.rollback(_applied(rec), rec["version"], _closed(rec)),
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
    Op.PROTOCOL_STEP: lambda core, rec: core.protocol_step(rec["pid"], Step(rec["step"]),
                                                           **rec["data"]),
    Op.ROLLBACK_REQUEUED: lambda core, rec: core.rollback_requeued(
        rec["pid"], _applied(rec), rec["version"], _closed(rec)),
    Op.PROTOCOL_CLOSE: lambda core, rec: core.protocol_close(rec["pid"]),
    Op.EXPORT_WRITTEN: lambda core, rec: core.export_written(rec["w"], rec["path"]),
    Op.EXPORT_LOST: lambda core, rec: core.export_lost(rec["pid"]),
    Op.EXPORT_OPEN: lambda core, rec: core.open_export(rec["source"]),
    Op.LAUNCH: _replay_launch,
    Op.GONE: lambda core, rec: core.replica_gone(rec["w"], rec["ok"], rec["key"],
                                                 rec["counts"]),
    Op.NOTE_EXIT: lambda core, rec: core.note_exit(rec["w"], rec["replica"], rec["fallback"]),
    Op.RESIZE: lambda core, rec: core.resize_workers(rec["min"], rec["max"], rec["reason"]),
    Op.HEALTH_RESTART: lambda core, rec: core.restart_health(),
    Op.DIVERGED: lambda core, rec: core.divergence_rollback(rec["source"], rec["now"]),
}


def replay(core: ReplayTarget, rec: Record) -> None:
    """Run ``rec`` again on ``core``. Raises JournalError for an unknown op or a
    decision unlike the journal's."""
    try:
        op = Op(rec["op"])
    except ValueError:
        raise JournalError(f"journal record {rec.get('seq')}: unknown op "
                           f"{rec['op']!r}") from None
    HANDLERS[op](core, rec)
