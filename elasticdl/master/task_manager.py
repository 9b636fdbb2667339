"""Dynamic data sharding: shards cut into tasks, handed out, re-queued, counted.

The :class:`TaskManager` is used in one process by the Local strategy and
behind the master's gRPC service by every distributed strategy. It never
imports torch. All public methods are thread-safe.

Ledger rules (they make ``job_report.json`` trustworthy):

* a training task's records count toward its epoch only when the task is
  reported done, and each task counts once even if it was handed out twice
  (straggler reassignment), so ``records_completed`` of a finished epoch is
  exactly the dataset size;
* records of a task handed out again after a failure, a dead worker or a
  timeout are added to ``records_redone`` of the task's epoch;
* a task that fails ``max_task_retries`` times (or once with ``fatal``) fails
  the job with that task and its last error as the root cause;
* ParameterServerStrategy: a worker reports with a task how many of its
  records the PS applied (``records_applied``, read back from the PS's
  applied-identity ledgers); a task counts only when all its records were
  applied, else it is re-queued and the next holder resumes after the
  minibatches already applied. ``records_applied`` of a finished epoch is then
  the dataset size, each record applied exactly once. After a PS rollback
  (:meth:`rollback`) tasks whose records are no longer all applied are
  re-queued.

Bookkeeping is sized by the live state (docs/scale.md): an epoch is a block of
consecutive task ids (:mod:`task_blocks`) handed out position by position, so
no epoch is materialised; finished tasks are the ``completed`` interval set
and per-epoch counters. Per-task detail (the task, the records it counted) is
kept only for *closed but unsettled* training tasks, the ones a PS rollback can
still re-open; :meth:`settle` drops it once a checkpoint on every PS holds them
(or at once with ``settle_on_close``: a job that can never roll back).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from elasticdl.common.intervals import IntervalSet
from elasticdl.common.task import NO_MORE_TASKS, WAIT_TASK, Task, TaskFailure, TaskType
from elasticdl.common.task_blocks import Block, PieceSource
from elasticdl.master.task_queue import TaskQueues
from elasticdl.master.task_state import (  # noqa: F401 - EpochLedger, make_tasks re-exported
    EVAL_TYPES,
    SUMMED_COUNTERS,
    Doing,
    EpochLedger,
    EvalJob,
    applied_short,
    data_position,
    holder,
    load_data_position,
    make_tasks,
    requeue_unapplied,
)
from elasticdl.master.task_timeouts import TaskTimeouts

logger = logging.getLogger(__name__)


class TaskManager(TaskQueues):
    """Hands out training, evaluation and prediction tasks and keeps the ledger.

    Args:
        training_shards / evaluation_shards / prediction_shards: ``(name, start,
            count)`` triples, e.g. from ``DataReader.create_shards()``.
        records_per_task: ``minibatch_size * num_minibatches_per_task``.
        num_epochs: passes over the training shards.
        shuffle: shuffle task order within each epoch (a permutation seeded by
            ``seed + epoch``).
        max_task_retries: attempts of one task before the job fails.
        task_timeout_s / min_task_timeout_s / initial_task_timeout_s: when a
            held task goes to another worker (see :class:`TaskTimeouts`).
        first_task_id: ids start here (the master starts each run at a new
            value: a PS ledger from an earlier run never matches a new task).
        epoch_barrier: an epoch's tasks are handed out only once the previous
            epoch is done (its epoch-end evaluation sees exactly that epoch).
        settle_on_close: no rollback can re-open a task (no PS checkpoints):
            keep no per-task detail of closed tasks at all.

    ``hold_training`` (set by the job core while an evaluation is due or runs)
    stops handing out training tasks; held ones finish as usual.
    """

    def __init__(
        self,
        training_shards: Sequence[Sequence[Any]] = (),
        evaluation_shards: Sequence[Sequence[Any]] = (),
        prediction_shards: Sequence[Sequence[Any]] = (),
        records_per_task: int = 512,
        num_epochs: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        max_task_retries: int = 3,
        task_timeout_s: float = 0.0,
        min_task_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        initial_task_timeout_s: float = 600.0,
        first_task_id: int = 0,
        epoch_barrier: bool = False,
        settle_on_close: bool = False,
    ):
        if records_per_task < 1:
            raise ValueError(f"records_per_task must be >= 1, got {records_per_task}")
        self._lock = threading.RLock()
        self._clock = clock
        # called with every block of tasks created, before any of it is handed out
        # (the data position's task table)
        self.block_created_callbacks: list[Callable[[Block], None]] = []
        self._records_per_task = records_per_task
        self._train_pieces: Sequence[tuple[str, int, int]] = PieceSource(
            training_shards, records_per_task)
        self._eval_pieces: Sequence[tuple[str, int, int]] = PieceSource(
            evaluation_shards, records_per_task)
        self._predict_pieces: Sequence[tuple[str, int, int]] = PieceSource(
            prediction_shards, records_per_task)
        self.training_records = sum(int(s[2]) for s in training_shards)
        self.evaluation_records = sum(int(s[2]) for s in evaluation_shards)
        self.prediction_records = sum(int(s[2]) for s in prediction_shards)
        self.num_epochs = num_epochs
        self._shuffle = shuffle
        self._seed = seed
        self.max_task_retries = max_task_retries
        self.timeouts = TaskTimeouts(task_timeout_s, min_task_timeout_s, initial_task_timeout_s)
        self.settle_on_close = settle_on_close
        self._next_id = first_task_id
        self._last_get: dict[int, tuple[int, Task]] = {}  # worker -> (request id, task)
        self.rollback_version = -1
        self.settled_version = -1          # the checkpoint version settled last
        self._blocks: list[Block] = []     # blocks with positions not handed out yet
        self._requeued: deque[Task] = deque()       # training / prediction, first out
        self._eval_requeued: deque[Task] = deque()
        self._doing: dict[int, Doing] = {}
        self._workers_seen: set[int] = set()
        self.completed = IntervalSet()     # ids of every task counted done
        # closed training tasks a rollback may still re-open: id -> (task, applied)
        # closed training tasks a rollback may re-open: (task, records applied, the
        # ledger generation those were read at: -1 unknown)
        self._unsettled: dict[int, tuple[Task, int, int]] = {}
        self._attempts: dict[int, int] = {}   # failures of tasks not done yet
        self._epochs_created = 0
        self._epoch_open_tasks: dict[int, int] = {}
        self.ledger: dict[int, EpochLedger] = {}
        self.prediction_ledger = EpochLedger()
        # epoch -> [unix s of its first training task out, of its last record done]: report
        # figures only, kept out of the state (a replay never sets them), so an epoch this
        # master process did not start (resumed, or in progress at a master restart) has none
        self.epoch_times: dict[int, list[float]] = {}
        self.evaluation_records_completed = 0
        self.evaluation_tasks_completed = 0
        self._eval_jobs: dict[int, EvalJob] = {}    # evaluations in progress
        self._evaluated = IntervalSet()             # model versions evaluated
        self.failure: Optional[TaskFailure] = None
        self.counters: dict[str, int] = {}   # e.g. nonfinite_steps_skipped, summed over tasks
        self.epoch_barrier = epoch_barrier
        self.hold_training = False
        self.epoch_end_callbacks: list[Callable[[int], None]] = []
        self.evaluation_done_callbacks: list[Callable[[int], Any]] = []
        if len(self._predict_pieces):
            self._new_block(len(self._predict_pieces), TaskType.PREDICTION, "predict", -1)

    # ------------------------------------------------------------ creation
    def _create_epoch(self) -> None:
        epoch = self._epochs_created
        n = len(self._train_pieces)
        self._new_block(n, TaskType.TRAINING, "train", epoch,
                        seed=self._seed + epoch if self._shuffle else None)
        self._epoch_open_tasks[epoch] = n
        self.ledger.setdefault(epoch, EpochLedger())
        self._epochs_created += 1
        logger.info("epoch %d: %d training tasks", epoch, n)

    def create_evaluation_tasks(self, model_version: int) -> bool:
        """Queue one evaluation pass over the validation shards for this version.

        Returns False (and queues nothing) when there is no validation data or
        that version is already being evaluated.
        """
        with self._lock:
            if not len(self._eval_pieces) or model_version in self._eval_jobs or \
                    model_version in self._evaluated:
                return False
            n = len(self._eval_pieces)
            self._new_block(n, TaskType.EVALUATION, "eval", -1, model_version)
            self._eval_jobs[model_version] = EvalJob(model_version, n)
            logger.info("evaluation of model version %d: %d tasks", model_version, n)
            return True

    def create_finalize_task(self, model_version: int) -> None:
        """Queue the task that merges the version's stateful metric states; the
        version's evaluation is done once it is."""
        with self._lock:
            self._new_block(1, TaskType.EVALUATION_FINALIZE, [("", 0, 0, -1)], -1,
                            model_version)
            # the version's tasks are done (the job closed): reopened for this one
            self._evaluated.remove(model_version)
            self._eval_jobs.setdefault(model_version, EvalJob(model_version)).remaining += 1

    # ------------------------------------------------------------ dispatch
    def get(self, worker_id: int, task_type: Optional[TaskType] = None,
            request_id: int = 0, reassign: bool = True) -> Task:
        """Next task for ``worker_id``: a real task, ``WAIT_TASK`` or ``NO_MORE_TASKS``.

        Evaluation tasks go first. ``task_type`` restricts the kind served. A
        repeated non-zero ``request_id`` (a client's retry after a lost reply)
        gets the task handed out for it the first time, if still held.
        """
        with self._lock:
            if self.failure is not None:
                return NO_MORE_TASKS
            if request_id:
                last = self._last_get.get(worker_id)
                if last is not None and last[0] == request_id:
                    doing = self._doing.get(last[1].task_id)
                    if doing is not None and doing.worker_id == worker_id:
                        logger.info("worker %d retried get_task %d: task %d again",
                                    worker_id, request_id, last[1].task_id)
                        return last[1]
            if reassign:   # False: a later get of one call at one time (nothing new)
                self._reassign_stragglers()
            task = self._pop(task_type)
            if task is None:
                return WAIT_TASK if not self._finished_locked() else NO_MORE_TASKS
            # re-inserted: held tasks stay in the order they went out (stragglers first)
            prev = self._doing.pop(task.task_id, None)
            past = prev.past | {holder(prev.worker_id)} if prev else frozenset()
            self._doing[task.task_id] = Doing(task, worker_id, self._clock(), past)
            if task.type == TaskType.TRAINING and task.epoch not in self.epoch_times and \
                    not self.ledger[task.epoch].tasks_completed:
                self.epoch_times[task.epoch] = [time.time(), 0.0]
            self._workers_seen.add(worker_id)
            if request_id:
                self._last_get[worker_id] = (request_id, task)
            return task

    def held_task(self, task_id: int) -> tuple[Optional[Task], frozenset[int]]:
        """The task ``task_id`` if some worker holds it now, and the workers that may
        report it (its holder and earlier holders it was reassigned from)."""
        with self._lock:
            doing = self._doing.get(task_id)
            if doing is None:
                return None, frozenset()
            return doing.task, doing.past | {holder(doing.worker_id)}

    def task_exists(self, task_id: int) -> bool:
        """True for an id this manager handed out or created."""
        with self._lock:
            return 0 <= task_id < self._next_id

    def has_worked(self, worker_id: int) -> bool:
        """True once ``worker_id`` was given a task."""
        with self._lock:
            return worker_id in self._workers_seen

    def _epoch_open(self) -> bool:
        return any(n > 0 for n in self._epoch_open_tasks.values())

    def training_held(self) -> int:
        """How many training tasks workers hold now (a reassigned straggler's copy
        counts while someone else holds it again)."""
        with self._lock:
            return sum(1 for d in self._doing.values()
                       if d.task.type == TaskType.TRAINING and d.worker_id >= 0)

    def report(self, task_id: int, worker_id: int, success: bool, error: str = "",
               traceback: str = "", fatal: bool = False,
               counters: Optional[Mapping[str, int]] = None) -> None:
        """Record the outcome of a task. Unknown or already-counted ids are ignored.

        ``counters``: ``records_applied`` (what the PS applied of the task; absent:
        all of it, as for strategies without PS) and ``applied_at_version`` (the
        PS version that figure was read at; older than the last rollback: stale).
        """
        counters = counters or {}
        epoch_done: Optional[int] = None
        eval_done: Optional[int] = None
        with self._lock:
            doing = self._doing.get(task_id)
            if task_id in self.completed:
                logger.info("task %d reported again by worker %d; counted once", task_id,
                            worker_id)
                self._doing.pop(task_id, None)
                return
            if doing is None:
                logger.warning("report for unknown task %d from worker %d ignored", task_id,
                               worker_id)
                return
            task = doing.task
            if not success:
                if doing.worker_id != worker_id:
                    return  # a straggler's copy failed; the reassigned copy runs on
                del self._doing[task_id]
                self._handle_failure(task, worker_id, error, traceback, fatal)
                return
            applied = counters.get("records_applied", task.num_records)
            if task.type == TaskType.TRAINING and self._short(task, applied, counters):
                if doing.worker_id == worker_id:
                    del self._doing[task_id]
                    self._requeue(task, redone=max(task.num_records - applied, 0))
                return
            del self._doing[task_id]
            self.completed.add(task_id)
            self._attempts.pop(task_id, None)
            for name in SUMMED_COUNTERS & counters.keys():
                self.counters[name] = self.counters.get(name, 0) + int(counters[name])
            self.timeouts.record(self._clock() - doing.started)
            if task.type == TaskType.TRAINING:
                self.ledger[task.epoch].records_applied += applied
                if not self.settle_on_close:
                    self._unsettled[task_id] = (
                        task, applied, int(counters.get("applied_generation", -1)))
            epoch_done, eval_done = self._count_done(task)
        if epoch_done is not None:
            for cb in self.epoch_end_callbacks:
                cb(epoch_done)
        if eval_done is not None:
            for cb in self.evaluation_done_callbacks:
                cb(eval_done)

    def _short(self, task: Task, applied: int, counters: Mapping[str, int]) -> bool:
        return applied_short(self, task, applied, counters)

    def rollback(self, applied: dict[int, int], new_version: int,
                 closed: Optional[IntervalSet] = None) -> list[int]:
        """The PS rolled back to a checkpoint whose ledgers hold ``applied`` (task ->
        records applied on every PS) and ``closed`` (tasks every PS holds whole);
        see :func:`task_state.requeue_unapplied`."""
        return requeue_unapplied(self, applied, new_version, closed)

    def settle(self, checkpoint_version: int, held: IntervalSet) -> int:
        """Closed tasks in ``held`` (what checkpoint ``checkpoint_version`` holds
        whole on every PS) can no longer be re-opened: their detail is dropped.
        Returns how many settled."""
        with self._lock:
            gone = [t for t in self._unsettled if t in held]
            for t in gone:
                del self._unsettled[t]
            self.settled_version = max(self.settled_version, checkpoint_version)
            return len(gone)

    def training_records_done(self) -> int:
        """Training records completed so far, every epoch (O(epochs))."""
        with self._lock:
            return sum(led.records_completed for led in self.ledger.values())

    def unsettled(self) -> int:
        """Closed training tasks a rollback may still re-open."""
        with self._lock:
            return len(self._unsettled)

    def _count_done(self, task: Task) -> tuple[Optional[int], Optional[int]]:
        if task.type == TaskType.TRAINING:
            led = self.ledger[task.epoch]
            led.records_completed += task.num_records
            led.tasks_completed += 1
            if task.epoch in self.epoch_times:
                self.epoch_times[task.epoch][1] = time.time()
            self._epoch_open_tasks[task.epoch] -= 1
            if self._epoch_open_tasks[task.epoch] == 0:
                logger.info("epoch %d done: %d records", task.epoch, led.records_completed)
                return task.epoch, None
        elif task.type in EVAL_TYPES:
            self.evaluation_records_completed += task.num_records
            self.evaluation_tasks_completed += 1
            job = self._eval_jobs.get(task.model_version)
            if job is not None:
                job.remaining -= 1
                if job.remaining <= 0:
                    del self._eval_jobs[task.model_version]
                    self._evaluated.add(task.model_version)
                    return None, task.model_version
        elif task.type == TaskType.PREDICTION:
            self.prediction_ledger.records_completed += task.num_records
            self.prediction_ledger.tasks_completed += 1
        return None, None

    def _handle_failure(self, task: Task, worker_id: int, error: str, tb: str,
                        fatal: bool) -> None:
        attempts = self._attempts.get(task.task_id, 0) + 1
        self._attempts[task.task_id] = attempts
        if fatal or attempts >= self.max_task_retries:
            self.failure = TaskFailure(task, worker_id, attempts, error, tb)
            logger.error("job fails: %s", self.failure.describe())
            return
        logger.warning("task %d failed on worker %d (attempt %d/%d): %s; re-queued",
                       task.task_id, worker_id, attempts, self.max_task_retries, error)
        self._requeue(task)

    def _requeue(self, task: Task, redone: Optional[int] = None) -> None:
        self._ledger_for(task).records_redone += task.num_records if redone is None else redone
        if task.type in EVAL_TYPES:
            self._eval_requeued.appendleft(task)
        else:
            self._requeued.appendleft(task)

    def _ledger_for(self, task: Task) -> EpochLedger:
        if task.type == TaskType.TRAINING:
            return self.ledger[task.epoch]
        if task.type == TaskType.PREDICTION:
            return self.prediction_ledger
        return EpochLedger()  # evaluation redo is not part of the report

    def recover_tasks(self, worker_id: int) -> list[Task]:
        """Re-queue every task held by a worker that died; returns them."""
        with self._lock:
            lost = [d.task for d in self._doing.values() if d.worker_id == worker_id]
            for task in lost:
                del self._doing[task.task_id]
                self._requeue(task)
            if lost:
                logger.info("worker %d lost %d task(s); re-queued: %s", worker_id, len(lost),
                            [t.task_id for t in lost])
            return lost

    def _reassign_stragglers(self) -> None:
        """Held tasks are in the order they went out: only the timed-out ones at
        the front (and reassigned ones, which stay there) are looked at."""
        timeout = self.timeouts.timeout()
        now = self._clock()
        for doing in self._doing.values():
            if doing.worker_id < 0:
                continue
            if now - doing.started <= timeout:
                break
            logger.warning("task %d held by worker %d for %.0f s (> %.0f s); reassigned",
                           doing.task.task_id, doing.worker_id, now - doing.started, timeout)
            # keep the straggler's claim alive but let another worker take it
            doing.worker_id = -1 - doing.worker_id
            self._requeue(doing.task)

    # --------------------------------------------------------------- state
    def _finished_locked(self) -> bool:
        training_left = self._epochs_created < self.num_epochs and bool(len(self._train_pieces))
        return not (self._has_todo() or self._eval_requeued or self._fresh(True) or
                    self._doing or training_left)

    def finished(self) -> bool:
        """True once every task (all epochs, evaluations, predictions) is done."""
        with self._lock:
            return self.failure is None and self._finished_locked()

    def counts(self) -> dict[str, int]:
        with self._lock:
            q = self.queued()
            evals = q.get(TaskType.EVALUATION, 0) + q.get(TaskType.EVALUATION_FINALIZE, 0)
            return {"todo": sum(q.values()) - evals, "eval_todo": evals,
                    "doing": len(self._doing), "completed": len(self.completed)}

    def epochs_report(self, timings: bool = False) -> list[dict[str, Any]]:
        """Per epoch: records completed, redone, applied; with ``timings`` also its
        wall seconds (first task out to last record done) and records/s."""
        with self._lock:
            out: list[dict[str, Any]] = []
            for e, led in sorted(self.ledger.items()):
                row: dict[str, Any] = {"epoch": e, "records_completed": led.records_completed,
                                       "records_redone": led.records_redone,
                                       "records_applied": led.records_applied}
                start, end = self.epoch_times.get(e, (0.0, 0.0))
                wall = end - start
                if timings and start and wall > 0:
                    row["wall_s"] = round(wall, 3)
                    row["records_per_s"] = round(led.records_completed / wall, 1)
                out.append(row)
            return out

    def prediction_report(self) -> dict[str, int]:
        with self._lock:
            return {"records_completed": self.prediction_ledger.records_completed,
                    "records_redone": self.prediction_ledger.records_redone}

    def state_dict(self, partial: Optional[dict[int, int]] = None) -> dict[str, Any]:
        """The data position (see :func:`task_state.data_position`)."""
        return data_position(self, partial)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (see :func:`task_state.load_data_position`)."""
        load_data_position(self, state)
