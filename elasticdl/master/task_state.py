"""The task manager's state types and their JSON form.

:class:`EpochLedger` is one epoch's figures in ``job_report.json``;
:func:`dump` / :func:`restore` turn a whole task manager (queues, held tasks,
ledger, evaluation passes, ids) into a JSON-able dict and back: the part of
the job core's state that master failover journals. They and the data position
reach the manager through :class:`TaskTables` (its tables, which
:class:`~elasticdl.master.task_manager.TaskManager` has), never importing it.
No torch.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from elasticdl.common.intervals import IntervalSet
from elasticdl.common.task import Task, TaskFailure, TaskType
from elasticdl.common.task_blocks import Block
from elasticdl.master.task_timeouts import TaskTimeouts

logger = logging.getLogger(__name__)


@dataclass
class EpochLedger:
    records_completed: int = 0
    records_redone: int = 0
    tasks_completed: int = 0
    records_applied: int = 0


# Counters of tasks that count as done, summed into TaskManager.counters (the
# others, e.g. records_applied, are per-task figures the ledger uses directly).
SUMMED_COUNTERS = frozenset({"nonfinite_steps_skipped", "records_skipped"})


@dataclass
class Doing:
    """A held task: its holder, since when, and earlier holders (reassigned
    stragglers; a reassigned straggler's ``worker_id`` is ``-1 - id``)."""

    task: Task
    worker_id: int
    started: float
    past: frozenset[int] = frozenset()


def holder(encoded: int) -> int:
    """A worker id from ``Doing.worker_id``."""
    return encoded if encoded >= 0 else -1 - encoded


@dataclass
class EvalJob:
    """An evaluation in progress: tasks of it not done yet."""

    model_version: int
    remaining: int = 0


EVAL_TYPES = (TaskType.EVALUATION, TaskType.EVALUATION_FINALIZE)


def make_tasks(shards: Iterable[Sequence[Any]],
               records_per_task: int) -> list[tuple[str, int, int]]:
    """Cut ``(name, start, count)`` shards into ``(name, start, end)`` pieces."""
    pieces = []
    for name, start, count in shards:
        end = start + count
        for s in range(start, end, records_per_task):
            pieces.append((name, s, min(s + records_per_task, end)))
    return pieces


def task_to_json(t: Task) -> list[Any]:
    return [t.task_id, int(t.type), t.shard_name, t.start, t.end, t.epoch, t.model_version]


def task_from_json(v: Sequence[Any]) -> Task:
    return Task(int(v[0]), TaskType(int(v[1])), str(v[2]), int(v[3]), int(v[4]), int(v[5]),
                int(v[6]))


class TaskTables(Protocol):
    """The task manager's tables as its JSON form (:func:`dump`, :func:`restore`)
    and its data position read and write them, under its lock (``TaskManager``
    has them all; see there what each holds)."""

    _lock: threading.RLock
    _next_id: int
    _blocks: list[Block]
    _requeued: deque[Task]
    _eval_requeued: deque[Task]
    _doing: dict[int, Doing]
    _unsettled: dict[int, tuple[Task, int, int]]
    _attempts: dict[int, int]
    _workers_seen: set[int]
    _epochs_created: int
    _epoch_open_tasks: dict[int, int]
    _eval_jobs: dict[int, EvalJob]
    _evaluated: IntervalSet
    _last_get: dict[int, tuple[int, Task]]
    completed: IntervalSet
    ledger: dict[int, EpochLedger]
    prediction_ledger: EpochLedger
    evaluation_records_completed: int
    evaluation_tasks_completed: int
    counters: dict[str, int]
    rollback_version: int
    settled_version: int
    hold_training: bool
    failure: Optional[TaskFailure]
    num_epochs: int

    @property
    def timeouts(self) -> TaskTimeouts: ...

    @property
    def sources(self) -> dict[str, Sequence[tuple[str, int, int]]]: ...

    def _new_block(self, count: int, typ: TaskType, source: Any, epoch: int = 0,
                   model_version: int = -1, seed: Optional[int] = None) -> Block: ...

    def _requeue(self, task: Task, redone: Optional[int] = None) -> None: ...


class Deferred:
    """A part of a state copied under the lock and turned into JSON outside it
    (:func:`resolve`): a snapshot holds the core's lock only for the copy."""

    def __init__(self, make: Callable[[], Any]):
        self.make = make


def resolve(state: Any) -> Any:
    """``state`` with every :class:`Deferred` (in nested dicts) made."""
    if isinstance(state, Deferred):
        return state.make()
    if isinstance(state, dict):
        return {k: resolve(v) for k, v in state.items()}
    return state


def dump(tm: TaskTables, defer: bool = False) -> dict[str, Any]:
    """Everything a restarted master needs to go on exactly where ``tm`` is: the
    live state only (blocks being handed out, re-queued and held tasks, closed
    but unsettled tasks), finished work as intervals and counters. ``defer``:
    the per-task lists are :class:`Deferred` (copied now, serialised later)."""
    with tm._lock:
        unsettled = list(tm._unsettled.values())
        doing = [(d.task, d.worker_id, d.past) for d in tm._doing.values()]
        requeued, eval_requeued = list(tm._requeued), list(tm._eval_requeued)
        state = _dump_locked(tm, {
            # the generation only when known (a snapshot of before reads back unchanged)
            "unsettled": Deferred(lambda: [[task_to_json(t), a] + ([g] if g > 0 else [])
                                           for t, a, g in unsettled]),
            "doing": Deferred(lambda: [[task_to_json(t), w, sorted(p)] for t, w, p in doing]),
            "requeued": Deferred(lambda: [task_to_json(t) for t in requeued]),
            "eval_requeued": Deferred(lambda: [task_to_json(t) for t in eval_requeued])})
    return state if defer else resolve(state)


def _dump_locked(tm: TaskTables, lists: dict[str, Deferred]) -> dict[str, Any]:
    failure = None
    if tm.failure is not None:
        f = tm.failure
        failure = [task_to_json(f.task), f.worker_id, f.attempts, f.error, f.traceback]
    return {
        "next_id": tm._next_id,
        "blocks": [b.to_json() for b in tm._blocks],
        **lists,
        "completed": tm.completed.to_flat(),
        "attempts": {str(k): v for k, v in tm._attempts.items()},
        "workers_seen": sorted(tm._workers_seen),
        "durations": list(tm.timeouts.durations),
        "epochs_created": tm._epochs_created,
        "epoch_open_tasks": {str(k): v for k, v in tm._epoch_open_tasks.items()},
        "ledger": {str(e): vars(led).copy() for e, led in tm.ledger.items()},
        "prediction_ledger": vars(tm.prediction_ledger).copy(),
        "evaluation_records_completed": tm.evaluation_records_completed,
        "evaluation_tasks_completed": tm.evaluation_tasks_completed,
        "eval_jobs": {str(v): j.remaining for v, j in tm._eval_jobs.items()},
        "evaluated": tm._evaluated.to_flat(),
        "counters": dict(tm.counters),
        "rollback_version": tm.rollback_version,
        "settled_version": tm.settled_version,
        "hold_training": tm.hold_training,
        "failure": failure,
    }


def restore(tm: TaskTables, state: dict[str, Any], now: float) -> None:
    """Put ``tm`` (built from the same shards and flags) in the state :func:`dump`
    gave; held tasks count as handed out at ``now``."""
    with tm._lock:
        tm._next_id = int(state["next_id"])
        tm._blocks = [Block.from_json(b) for b in state["blocks"]]
        tm._requeued = deque(task_from_json(t) for t in state["requeued"])
        tm._eval_requeued = deque(task_from_json(t) for t in state["eval_requeued"])
        tm._doing = {}
        for t, worker, past in state["doing"]:
            task = task_from_json(t)
            tm._doing[task.task_id] = Doing(task, int(worker), now, frozenset(past))
        tm.completed = IntervalSet.from_flat(state["completed"])
        tm._unsettled = {}
        for t, applied, *gen in state["unsettled"]:
            task = task_from_json(t)
            tm._unsettled[task.task_id] = (task, int(applied), int(gen[0]) if gen else -1)
        tm._attempts = {int(k): int(v) for k, v in state["attempts"].items()}
        tm._workers_seen = set(state["workers_seen"])
        tm.timeouts.restore(state["durations"])
        tm._epochs_created = int(state["epochs_created"])
        tm._epoch_open_tasks = {int(k): int(v) for k, v in state["epoch_open_tasks"].items()}
        tm.ledger = {int(e): EpochLedger(**v) for e, v in state["ledger"].items()}
        tm.prediction_ledger = EpochLedger(**state["prediction_ledger"])
        tm.evaluation_records_completed = int(state["evaluation_records_completed"])
        tm.evaluation_tasks_completed = int(state["evaluation_tasks_completed"])
        tm._eval_jobs = {int(v): EvalJob(int(v), int(r)) for v, r in state["eval_jobs"].items()}
        tm._evaluated = IntervalSet.from_flat(state["evaluated"])
        tm.counters = dict(state["counters"])
        tm.rollback_version = int(state["rollback_version"])
        tm.settled_version = int(state["settled_version"])
        tm.hold_training = bool(state["hold_training"])
        tm._last_get = {}
        tm.failure = None
        if state["failure"] is not None:
            t, worker, attempts, error, tb = state["failure"]
            tm.failure = TaskFailure(task_from_json(t), int(worker), int(attempts), error, tb)


def data_position(tm: TaskTables, partial: Optional[dict[int, int]] = None
                  ) -> dict[str, Any]:
    """The data position: every training task not yet done, for resuming.

    ``partial`` maps a task id in progress to the records of it already
    trained (a checkpoint taken mid-task); those records count as done and
    only the rest of the task is pending after a restore.
    """
    partial = partial or {}
    with tm._lock:
        ledger = {e: dict(vars(led)) for e, led in tm.ledger.items()}
        pending = []
        queued = [d.task for d in tm._doing.values()] + list(tm._requeued)
        for block in tm._blocks:
            if block.type == TaskType.TRAINING:
                queued += (block.task(p, tm.sources) for p in range(block.next, block.count))
        for task in queued:
            if task.type != TaskType.TRAINING:
                continue
            done = partial.get(task.task_id, 0)
            if done:
                ledger[task.epoch]["records_completed"] += done
                ledger[task.epoch]["records_applied"] += done
            if task.start + done < task.end:
                pending.append([task.shard_name, task.start + done, task.end, task.epoch])
        return {"epochs_created": tm._epochs_created, "pending": pending,
                "ledger": ledger, "num_epochs": tm.num_epochs}


def load_data_position(tm: TaskTables, state: dict[str, Any]) -> None:
    """Resume from :func:`data_position`: only the pending tasks are left of
    the epochs already created (one block of explicit ranges); later epochs are
    created as usual."""
    with tm._lock:
        if tm._doing or tm.completed:
            raise RuntimeError("load_state_dict on a task manager already in use")
        tm._requeued = deque(t for t in tm._requeued if t.type != TaskType.TRAINING)
        tm._blocks = [b for b in tm._blocks if b.type != TaskType.TRAINING]
        tm._epochs_created = int(state["epochs_created"])
        # a data position saved before records_applied existed: what was done was applied
        tm.ledger = {int(e): EpochLedger(**{"records_applied": v["records_completed"],
                                              **v}) for e, v in state["ledger"].items()}
        tm._epoch_open_tasks = {e: 0 for e in tm.ledger}
        pieces = [(str(p[0]), int(p[1]), int(p[2]), int(p[3])) for p in state["pending"]
                  if len(p) == 4]
        # an earlier run's tasks its PS hold differently: whole, under their own ids (the
        # restored ledgers name them; data_position.position), first out
        carried = [Task(int(p[4]), TaskType.TRAINING, str(p[0]), int(p[1]), int(p[2]),
                        int(p[3])) for p in state["pending"] if len(p) == 5]
        for epoch in [p[3] for p in pieces] + [t.epoch for t in carried]:
            tm._epoch_open_tasks[epoch] = tm._epoch_open_tasks.get(epoch, 0) + 1
        tm._requeued.extend(carried)
        # new ids above every earlier run's (the restored PS ledgers hold those)
        tm._next_id = max(tm._next_id, int(state.get("id_floor", 0)),
                          max((t.task_id + 1 for t in carried), default=0))
        if pieces:
            tm._new_block(len(pieces), TaskType.TRAINING, pieces, -1)
        logger.info("resumed data position: epoch %d, %d pending task(s) (%d of an earlier "
                    "run, under their own ids)", max(tm._epochs_created - 1, 0),
                    len(pieces) + len(carried), len(carried))


def applied_short(tm: TaskTables, task: Task, applied: int,
                  counters: Mapping[str, int]) -> bool:
    """Whether a task reported done still has records the PS did not apply.

    The figure is stale (read before the last PS rollback or lone restore, which
    may have dropped what it counts) when the oldest ledger generation the worker
    read (``applied_generation``: every PS's, the lowest; a PS takes the master's
    rollback version as its generation when it rolls back or restores, or is told
    it) is below the master's rollback version; from a worker that does not send
    it, when the lowest PS version it read (``applied_at_version``) is below it.
    After a lone restore (``--ps_recovery=alone``) only the restored PS's version
    continues above the rollback version, so only the generation can tell."""
    gen = counters.get("applied_generation")
    if gen is not None and gen < tm.rollback_version:
        logger.warning("task %d: applied records read at ledger generation %d, before the "
                       "PS rollback to %d; re-queued", task.task_id, gen,
                       tm.rollback_version)
        return True
    at = counters.get("applied_at_version")
    if gen is None and at is not None and at < tm.rollback_version:
        logger.warning("task %d: applied records read at PS version %d, before the "
                       "rollback to %d; re-queued", task.task_id, at, tm.rollback_version)
        return True
    expected = min(task.num_records, counters.get("records_read", task.num_records))
    expected -= counters.get("records_skipped", 0)  # --skip_nonfinite_steps
    if applied < expected:
        logger.warning("task %d reported done but the PS applied %d of its %d records; "
                       "re-queued (it resumes after the applied minibatches)",
                       task.task_id, applied, expected)
        return True
    return False


def requeue_unapplied(tm: TaskTables, applied: dict[int, int], new_version: int,
                      closed: Optional[IntervalSet] = None) -> list[int]:
    """The PS rolled back to a checkpoint whose ledgers hold ``applied`` (task ->
    records applied on every PS) and ``closed`` (tasks every PS holds whole):
    closed but unsettled training tasks not fully in it are re-queued (their
    records leave the epoch's counts); settled ones are in it by construction,
    and so are those whose applied records a worker read at ledger generation
    ``new_version`` or above (every PS it read was past the rollback or lone
    restore: finished there while the master was on its way here). Returns them."""
    with tm._lock:
        tm.rollback_version = new_version
        lost = []
        for task_id in sorted(tm._unsettled):
            task, counted, generation = tm._unsettled[task_id]
            if closed is not None and task_id in closed or \
                    applied.get(task_id, 0) >= counted or generation >= new_version:
                continue   # held (a figure read at this generation: after the restore)
            led = tm.ledger[task.epoch]
            led.records_completed -= task.num_records
            led.records_applied -= counted
            led.tasks_completed -= 1
            if tm._epoch_open_tasks.get(task.epoch, 0) == 0:
                logger.warning("epoch %d was complete; reopened by the rollback", task.epoch)
            tm._epoch_open_tasks[task.epoch] = tm._epoch_open_tasks.get(task.epoch, 0) + 1
            tm.completed.remove(task_id)
            del tm._unsettled[task_id]
            tm._requeue(task, redone=counted - applied.get(task_id, 0))
            lost.append(task_id)
        logger.warning("PS rollback (versions continue at %d): %d done task(s) re-queued: %s",
                       new_version, len(lost), lost)
        return lost
