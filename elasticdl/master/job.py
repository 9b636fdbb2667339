"""The job core: every decision of a job, in one object with serialisable state.

:class:`JobCore` owns the :class:`TaskManager` (tasks, per-epoch ledger), the
:class:`EvaluationAggregator`, the :class:`Schedule`, the :class:`JobReport`,
the job's model version and the relaunch bookkeeping (:class:`ReplicaBook`).
The Local strategy runs it in process behind ``LocalTaskSource``; the gRPC
master runs it behind its servicer, and the :class:`JobController` only
applies its decisions on the cluster. :meth:`JobCore.state_dict` is a JSON-able
dict a restarted master can continue from (:meth:`JobCore.load_state_dict`).

Evaluation is a barrier. When one is due (the periodic rule of the Schedule,
an epoch's end, the end of training), training tasks stop going out (workers
are told WAIT); once no worker holds a training task any more the model no
longer changes, and the evaluation tasks are created labelled with the job's
version at that moment: the version they actually evaluate. Training resumes
when the evaluation is complete. Reasons that fall on one version share one
evaluation (``{"model_version", "metrics", "reasons", "epoch"}`` in the
report); the final one runs after the last training task and before the
model is exported, so ``final_metrics`` describe ``model.pt``. An epoch's
tasks go out only once the previous epoch is done, so an epoch-end evaluation
sees exactly the epochs up to its own.

Versions. Workers report their model version with every task result and, for
progress, now and then. A version is validated against an upper bound: each
training minibatch makes at most one model version (Local and allreduce: one
step; PS: one push applied per PS, sync ones fewer), so no honest client
reports more than ``start + minibatches handed out`` (``start``: the version
the job resumed from or the PS rolled back to, whichever is larger). Above
that: :class:`VersionError` (INVALID_ARGUMENT on the wire). Older versions are
accepted and never move the job's version back.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple, Optional

from elasticdl.common.enums import JobType, Strategy
from elasticdl.common.intervals import IntervalSet
from elasticdl.common.job_report import JobReport, exported_model_version
from elasticdl.common.schedule import Schedule
from elasticdl.common.task import Task, TaskType
from elasticdl.master import task_state
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.job_journal import Journaled
from elasticdl.master.lr_plateau import MetricSchedule
from elasticdl.master.protocols import ProtocolBook
from elasticdl.master.recovery import Recovery
from elasticdl.master.replicas import ReplicaBook
from elasticdl.master.task_manager import TaskManager

logger = logging.getLogger(__name__)


class Refusal(NamedTuple):
    """A result of a batch refused (:meth:`JobCore.report_tasks`): its position in
    the batch, why, and whether the request was invalid (else the worker may not
    report it)."""

    position: int
    reason: str
    invalid: bool


class TaskResult(NamedTuple):
    """One task outcome of a batch (:meth:`JobCore.report_tasks`), in the order of
    :meth:`JobCore.report_task`'s arguments after the worker."""

    task_id: int
    success: bool
    error: str = ""
    traceback: str = ""
    fatal: bool = False
    counters: Optional[Mapping[str, int]] = None
    model_version: Optional[int] = None
    loss: Optional[float] = None
    learning_rate: Optional[float] = None

Metric = tuple[str, float, int]


class VersionError(ValueError):
    """A model version no task handed out so far could have produced."""


class JobCore(Journaled, Recovery):
    """Args:
        minibatch_size: records per training step (bounds reported versions).
        start_version: the model version the job starts from (a resumed checkpoint).
        manage_evaluations: False leaves evaluations to whoever queues them on the
            task manager (tests and tools around a bare task manager).
    """

    def __init__(self, task_manager: TaskManager, report: JobReport,
                 schedule: Optional[Schedule] = None, *, minibatch_size: int = 64,
                 job_type: JobType = JobType.TRAIN, start_version: int = 0,
                 aggregator: Optional[EvaluationAggregator] = None,
                 manage_evaluations: bool = True):
        self.tm = task_manager
        self.report = report
        self.schedule = schedule or Schedule()
        self.minibatch_size = minibatch_size
        self.job_type = job_type
        self.aggregator = aggregator or EvaluationAggregator()
        self.replicas = ReplicaBook()
        self.protocols = ProtocolBook()   # open recovery protocols (see recovery.py)
        self._lock = threading.RLock()
        self.version = self._start = self._last_due = start_version
        self._minibatches_out = 0
        self._rollbacks_pending = 0   # PS rollbacks under way (see begin_rollback)
        self._last_evaluated: Optional[int] = None
        self._pending: Optional[dict[str, Any]] = None   # {"reasons", "epoch"}
        self._running: Optional[dict[str, Any]] = None   # {"version", "reasons", "epoch"}
        self._begun = False
        self._epochs_ended: set[int] = set()
        self._manage = manage_evaluations
        self._listeners: list[Any] = []
        # a metric-driven LR schedule (ReduceLROnPlateau), stepped at each evaluation
        self.metric_schedule: Optional[MetricSchedule] = None
        # called with the core after each refresh_report (the job history writer)
        self.refresh_hooks: list[Any] = []
        self._init_journal(task_manager)
        task_manager.evaluation_done_callbacks.append(self._on_evaluation_done)
        if manage_evaluations:
            task_manager.epoch_end_callbacks.append(self._on_epoch_end)
            # an epoch is a real boundary, as in one process: epoch-end evaluations
            # see exactly that epoch, and per-epoch LR schedules change between epochs
            task_manager.epoch_barrier = job_type == JobType.TRAIN

    @classmethod
    def for_tasks(cls, task_manager: TaskManager,
                  aggregator: Optional[EvaluationAggregator] = None, **kwargs: Any) -> JobCore:
        """A core around a bare task manager that leaves evaluations to its caller
        (tests, benchmarks, tools)."""
        kwargs.setdefault("manage_evaluations", False)
        return cls(task_manager, JobReport("job", "", "", 1, 0), aggregator=aggregator,
                   **kwargs)

    @classmethod
    def from_spec(cls, spec: Any, readers: Mapping[TaskType, Any], first_task_id: int = 0,
                  start_version: int = 0) -> JobCore:
        """The one place a job's task manager, schedule and report are built."""
        from elasticdl.data.datasets import shards_for

        # wall-clock time: held tasks' start times stay meaningful across a master restart;
        # only a PS job that writes checkpoints can roll back (re-open closed tasks)
        rollbacks = spec.distribution_strategy == Strategy.PS and \
            bool(spec.checkpoint_dir)
        tm = TaskManager(records_per_task=spec.records_per_task, num_epochs=spec.num_epochs,
                         shuffle=spec.shuffle, seed=spec.seed,
                         max_task_retries=spec.max_task_retries,
                         task_timeout_s=spec.task_timeout_s, first_task_id=first_task_id,
                         clock=time.time, settle_on_close=not rollbacks,
                         **shards_for(dict(readers), spec))
        report = report_for(spec, tm)
        core = cls(tm, report, Schedule.from_spec(spec), minibatch_size=spec.minibatch_size,
                   job_type=spec.job_type, start_version=start_version)
        core.metric_schedule = MetricSchedule.from_spec(spec)
        return core

    # ------------------------------------------------------------- versions
    def start_at_version(self, version: int) -> None:
        """The model the job starts from has ``version`` (a restored checkpoint)."""
        with self._lock:
            self.version = self._start = self._last_due = version
            self._log("start_at", version=version)

    def version_bound(self) -> int:
        with self._lock:
            return max(self._start, self.tm.rollback_version) + self._minibatches_out

    def begin_rollback(self) -> None:
        """A PS rollback starts: until :meth:`rollback` says at which version versions
        continue, the bound is unknown (the PS may already apply pushes above it), so
        versions above it are ignored, not refused; they come again with later reports."""
        with self._lock:
            self._rollbacks_pending += 1
            self._log("begin_rollback")

    def end_rollback(self) -> None:
        """The PS rollback failed (the job fails); the bound holds again."""
        with self._lock:
            self._rollbacks_pending = max(self._rollbacks_pending - 1, 0)
            self._log("end_rollback")

    def on_version(self, worker_id: int, version: int) -> None:
        """A worker's model version. Raises VersionError above :meth:`version_bound`."""
        with self._lock:
            before = (self.version, self._last_due, self._pending)
            self._on_version(worker_id, version)
            if before != (self.version, self._last_due, self._pending):
                self._log("version", w=worker_id, version=version)

    def _on_version(self, worker_id: int, version: int) -> None:
        with self._lock:
            bound = self.version_bound()
            if version > bound and (self._rollbacks_pending or self.rolling_back()):
                logger.info("model version %d from worker %d during a PS rollback: ignored "
                            "until the rollback settles", version, worker_id)
                return
            if version > bound:
                raise VersionError(
                    f"model version {version} from worker {worker_id} is ahead of what the "
                    f"job could have produced ({bound}: start version plus the training "
                    "minibatches handed out so far)")
            if version <= self.version:
                return  # stale or known: never moves anything back
            self.version = version
            if self.job_type == JobType.TRAIN and self.schedule.eval_due(version,
                                                                          self._last_due):
                self._last_due = version
                self._request_evaluation("periodic", None)

    # ---------------------------------------------------------------- tasks
    def begin(self) -> None:
        """Start the job (an evaluate job queues its one evaluation). Idempotent."""
        with self._lock:
            if not self._begun and self.job_type == JobType.EVALUATE:
                self._request_evaluation("evaluate", None)
            if not self._begun:
                self._log("begin")
            self._begun = True

    def get(self, worker_id: int, task_type: Optional[TaskType] = None,
            request_id: int = 0) -> Task:
        """The next task for ``worker_id`` (see :meth:`TaskManager.get`)."""
        with self._lock, self._at() as t:
            task = self._get_locked(worker_id, task_type, request_id)
            self._log("get", t=t, w=worker_id, r=request_id, task=task_state.task_to_json(task),
                      type=None if task_type is None else int(task_type))
            return task

    def _get_locked(self, worker_id: int, task_type: Optional[TaskType],
                    request_id: int = 0, reassign: bool = True) -> Task:
        self._maybe_start_evaluation()
        task = self.tm.get(worker_id, task_type, request_id, reassign)
        if task.type == TaskType.TRAINING:
            self._minibatches_out += -(-task.num_records // self.minibatch_size)
        return task

    def get_tasks(self, worker_id: int, task_type: Optional[TaskType], max_tasks: int,
                  share: Optional[Callable[[], int]] = None) -> list[Task]:
        """Up to ``max_tasks`` next tasks for ``worker_id`` in one call and one journal
        record (a lease, :mod:`elasticdl.master.leases`): gets until a WAIT / NONE,
        which ends the list (returned only when it is the first). ``share``, asked
        after the first task, caps the count (a fair share of the queue)."""
        with self._lock, self._at() as t:
            got: list[Task] = []
            cap = max_tasks
            while len(got) < cap:
                # stragglers are looked for once: the call's gets share one time
                task = self._get_locked(worker_id, task_type, reassign=not got)
                got.append(task)
                if task.type in (TaskType.WAIT, TaskType.NONE):
                    break
                if len(got) == 1 and cap > 1 and share is not None:
                    cap = min(cap, share())
            self._log("lease", t=t, w=worker_id, type=None if task_type is None
                      else int(task_type), tasks=[task_state.task_to_json(x) for x in got])
        if len(got) > 1 and got[-1].type in (TaskType.WAIT, TaskType.NONE):
            got.pop()   # the tasks it had; the next call learns the queue ran dry
        return got

    def report_task(self, task_id: int, worker_id: int, success: bool, error: str = "",
                    traceback: str = "", fatal: bool = False,
                    counters: Optional[Mapping[str, int]] = None,
                    model_version: Optional[int] = None, loss: Optional[float] = None,
                    learning_rate: Optional[float] = None) -> None:
        """A task's outcome, with the reporter's model version after it and, for a
        training task, its mean loss and last learning rate (job report "training").
        Raises VersionError (nothing recorded) for a version from the future."""
        with self._lock, self._at() as t:
            trained = self._report_locked(task_id, worker_id, success, error, traceback,
                                          fatal, counters, model_version, loss, learning_rate)
            self._log("report", t=t, task=task_id, w=worker_id, ok=success, error=error,
                      tb=traceback, fatal=fatal, counters=dict(counters or {}),
                      version=model_version, loss=loss, lr=learning_rate)
            if trained is not None:
                self.notify("on_training_task", epoch=trained.epoch, records=trained.num_records,
                            loss=loss, learning_rate=learning_rate, version=self.version)

    def report_tasks(self, worker_id: int, results: Sequence[TaskResult]
                     ) -> list[Refusal]:
        """Several of ``worker_id``'s task outcomes, in order, in one call and one
        journal record (what a lease's next call carries). Returns the ones refused,
        nothing recorded for them (the rest are): an unknown task id or a version
        from the future (``invalid``), a task the worker does not hold (held by
        another worker, that is, reassigned away and not reassigned from it)."""
        refused: list[Refusal] = []
        with self._lock, self._at() as t:
            kept, trained = [], []
            for i, r in enumerate(results):
                if not self.tm.task_exists(r.task_id):
                    refused.append(Refusal(i, f"unknown task_id {r.task_id}", True))
                    continue
                task, holders = self.tm.held_task(r.task_id)
                if task is not None and worker_id not in holders:
                    refused.append(Refusal(i, f"worker {worker_id} does not hold task "
                                           f"{r.task_id} (held by {sorted(holders)})", False))
                    continue
                try:
                    done = self._report_locked(r.task_id, worker_id, *r[1:])
                except VersionError as e:
                    refused.append(Refusal(i, str(e), True))
                    continue
                kept.append([r.task_id, r.success, r.error, r.traceback, r.fatal,
                             dict(r.counters or {}), r.model_version, r.loss, r.learning_rate])
                if done is not None:
                    trained.append((done, r.loss, r.learning_rate))
            if kept:
                self._log("reports", t=t, w=worker_id, results=kept)
            for task, loss, lr in trained:
                self.notify("on_training_task", epoch=task.epoch, records=task.num_records,
                            loss=loss, learning_rate=lr, version=self.version)
        return refused

    def _report_locked(self, task_id: int, worker_id: int, success: bool, error: str = "",
                       traceback: str = "", fatal: bool = False,
                       counters: Optional[Mapping[str, int]] = None,
                       model_version: Optional[int] = None, loss: Optional[float] = None,
                       learning_rate: Optional[float] = None) -> Optional[Task]:
        """One outcome (see :meth:`report_task`), unjournaled; the training task it
        completed for the report, or None."""
        if model_version is not None:
            self._on_version(worker_id, model_version)
        task, holders = self.tm.held_task(task_id)
        self.tm.report(task_id, worker_id, success, error, traceback, fatal, counters)
        trained = task if success and task is not None and worker_id in holders and \
            task.type == TaskType.TRAINING else None
        if trained is not None:
            self.report.add_training(trained.epoch, trained.num_records, loss, learning_rate)
        self._maybe_start_evaluation()
        return trained

    def report_evaluation(self, task_id: int, model_version: int,
                          metrics: Sequence[Metric], states: bytes = b"") -> None:
        """One evaluation task's metrics and serialised metric states, or a finalize
        task's merged values (see :mod:`elasticdl.master.evaluation`). Raises
        MetricStateError (nothing recorded) for states beyond the bounds."""
        with self._lock:
            task, _ = self.tm.held_task(task_id)
            if task is not None and task.type == TaskType.EVALUATION_FINALIZE:
                self.aggregator.add_final(model_version, metrics)
            else:
                self.aggregator.add(model_version, task_id, metrics, states)
            fields: dict[str, Any] = {}
            if states:
                fields["states"] = base64.b64encode(states).decode("ascii")
            self._log("metrics", task=task_id, version=model_version,
                      metrics=[list(m) for m in metrics], **fields)

    def evaluation_states(self, model_version: int) -> tuple[bytes, ...]:
        """The metric states a finalize task of ``model_version`` merges."""
        return self.aggregator.states_for(model_version)

    def worker_reported(self, worker_id: int, message: str, traceback: str) -> None:
        """A worker's own report of its failure (the job's root cause candidate)."""
        with self._lock:
            self.replicas.worker_reported(worker_id, message, traceback)
            self._log("worker_reported", w=worker_id, error=message, tb=traceback)

    def recover_tasks(self, worker_id: int) -> list[Task]:
        """Re-queue what a dead worker held."""
        with self._lock, self._at() as t:
            lost = self.tm.recover_tasks(worker_id)
            self._maybe_start_evaluation()
            self._log("recover", t=t, w=worker_id)
            return lost

    def rollback(self, applied: dict[int, int], new_version: int,
                 closed: Optional[IntervalSet] = None) -> list[int]:
        """The PS rolled back to a checkpoint; versions continue at ``new_version``.
        ``applied``: per task, the records every restored PS holds; ``closed``:
        tasks every restored PS holds whole (its compacted ledgers)."""
        with self._lock:
            lost = self._rollback(applied, new_version, closed)
            self._log("rollback", applied={str(k): v for k, v in applied.items()},
                      version=new_version, closed=None if closed is None else closed.to_flat())
            return lost

    def lr_reductions(self) -> int:
        """Reductions of a metric-driven LR schedule decided so far (0: none)."""
        with self._lock:
            ms = self.metric_schedule
            return ms.reductions() if ms is not None else 0

    def _rollback(self, applied: dict[int, int], new_version: int,
                  closed: Optional[IntervalSet] = None) -> list[int]:
        lost = self.tm.rollback(applied, new_version, closed)
        self.version = max(self.version, new_version)
        self._rollbacks_pending = max(self._rollbacks_pending - 1, 0)
        return lost

    def closed_tasks(self) -> tuple[int, IntervalSet]:
        """``(generation, closed)``: the generation is the rollback version (a PS
        that rolled back to a higher one ignores this set); ``closed`` a copy of
        the ids of every task counted done (training tasks the PS folds; the ids
        of evaluation and prediction tasks hold no PS work)."""
        with self._lock:
            return self.tm.rollback_version, self.tm.completed.copy()

    def settle(self, checkpoint_version: int, held: IntervalSet) -> int:
        """Checkpoint ``checkpoint_version`` is complete on every PS and holds the
        tasks ``held`` whole on each: closed tasks among them can no longer be
        re-opened by a rollback, so their per-task detail goes. Returns how many
        settled."""
        with self._lock:
            n = self.tm.settle(checkpoint_version, held)
            self._log("settle", version=checkpoint_version, held=held.to_flat())
            return n

    def held_task(self, task_id: int) -> tuple[Optional[Task], frozenset[int]]:
        return self.tm.held_task(task_id)

    def task_exists(self, task_id: int) -> bool:
        return self.tm.task_exists(task_id)

    def has_worked(self, worker_id: int) -> bool:
        return self.tm.has_worked(worker_id)

    def finished(self) -> bool:
        """Every task done, no evaluation due or running, no PS rollback open."""
        with self._lock:
            return self._pending is None and self._running is None and \
                self.tm.finished() and not self.rolling_back()

    def resize_workers(self, low: int, high: int, reason: str) -> dict[str, Any]:
        """New worker bounds MIN:MAX (``elasticdl scale``), journaled; the job
        controller reconciles the workers (elasticdl/master/scaling.py). Raises
        ValueError for bad bounds, LookupError without worker bookkeeping."""
        with self._lock, self._at() as t:
            counts = self.attachments.get("scaling")
            if counts is None:
                raise LookupError("this job keeps no worker bookkeeping")
            entry = counts.resize(low, high, reason)
            self._log("resize", t=t, min=low, max=high, reason=reason)
            return dict(entry)

    # ----------------------------------------------------------- evaluation
    def _request_evaluation(self, reason: str, epoch: Optional[int]) -> None:
        if not self.tm.evaluation_records or not self._manage:
            return
        target = self._running or self._pending
        if target is None:
            target = self._pending = {"reasons": [], "epoch": None}
            self.tm.hold_training = True
        if reason not in target["reasons"]:
            target["reasons"].append(reason)
        if epoch is not None:
            target["epoch"] = epoch
        logger.info("evaluation due (%s) at model version %d", ", ".join(target["reasons"]),
                    self.version)

    def _maybe_start_evaluation(self) -> None:
        pending = self._pending
        if pending is None or self.tm.training_held():
            return
        self._pending = None
        version = self.version
        if version == self._last_evaluated:  # this very model was evaluated already
            self.report.add_reasons(pending["reasons"], pending["epoch"])
            self.tm.hold_training = False
            return
        if not self.tm.create_evaluation_tasks(version):
            logger.warning("model version %d was evaluated before; %s not repeated", version,
                           pending["reasons"])
            self.tm.hold_training = False
            return
        self._running = {"version": version, **pending}

    def _on_evaluation_done(self, version: int) -> None:
        running = self._running
        if running is None or running["version"] != version:
            return  # evaluation tasks queued on the task manager directly (tests, tools)
        if self.aggregator.needs_finalize(version):
            # stateful metrics: one more task merges the states on a worker
            self.tm.create_finalize_task(version)
            return
        metrics = self.aggregator.complete(version)
        self.report.add_evaluation(version, metrics, running["reasons"], running["epoch"])
        if self.metric_schedule is not None:
            self.metric_schedule.on_evaluation(version, metrics)
            self.report.extra["lr_schedule"] = self.metric_schedule.summary()
        self.notify("on_evaluation", version=version, metrics=dict(metrics))
        self._last_evaluated = version
        self._running = None
        self.tm.hold_training = self._pending is not None

    def _after_rollback(self, lost: list[int]) -> None:
        """A PS rollback re-queued ``lost``: evaluations it interrupted run again on
        the model as it then is (see :func:`recovery.evaluations_after_rollback`)."""
        from elasticdl.master.recovery import evaluations_after_rollback

        evaluations_after_rollback(self)

    def _on_epoch_end(self, epoch: int) -> None:
        if self.job_type != JobType.TRAIN:
            return
        with self._lock:
            if epoch in self._epochs_ended:
                # a PS rollback reopened a finished epoch: its end was evaluated once
                logger.info("epoch %d ended again (PS rollback); its epoch-end evaluation "
                            "ran already", epoch)
            else:
                self._epochs_ended.add(epoch)
                self._request_evaluation("epoch_end", epoch)
                self.notify("on_epoch_end", epoch=epoch, version=self.version)
            if epoch >= self.tm.num_epochs - 1 and self.tm.training_records_left() == 0:
                self._request_evaluation("final", epoch)

    # ------------------------------------------------------------ listeners
    def add_listener(self, listener: Any) -> None:
        """``listener`` hears of the job's events by method name (see
        :class:`elasticdl.master.observability.JobListener`): ``on_training_task``,
        ``on_evaluation``, ``on_epoch_end``, ``on_relaunch``. Called under the core's
        lock (from gRPC handlers): a listener returns at once (queues, never blocks)."""
        self._listeners.append(listener)

    def notify(self, event: str, **fields: Any) -> None:
        """Tell every listener of ``event``; a listener's error is logged, never
        fails the job (observability must not stop training)."""
        for listener in self._listeners:
            try:
                getattr(listener, event)(**fields)
            except Exception:  # noqa: BLE001 - logged with its traceback
                logger.exception("job listener %r failed on %s", listener, event)

    # --------------------------------------------------------------- report
    def refresh_report(self) -> JobReport:
        """Bring the report's figures up to date (the caller writes it)."""
        tm, report = self.tm, self.report
        report.epochs = tm.epochs_report(timings=True)
        report.extra["records_predicted"] = tm.prediction_ledger.records_completed
        if self.job_type == JobType.PREDICT:
            report.extra["prediction"] = tm.prediction_report()
        report.extra["model_version"] = self.version
        report.extra["nonfinite_steps_skipped"] = tm.counters.get("nonfinite_steps_skipped", 0)
        for hook in self.refresh_hooks:
            hook(self)
        return report

    # ---------------------------------------------------------------- state
    def state_dict(self, defer: bool = False) -> dict[str, Any]:
        """The whole job state as a JSON-able dict (``defer``: its per-task lists
        as :class:`task_state.Deferred`, made by :func:`task_state.resolve`
        outside the lock)."""
        with self._lock:
            return {
                "tasks": task_state.dump(self.tm, defer),
                "replicas": self.replicas.state_dict(),
                "protocols": self.protocols.state_dict(),
                "report": self.report.state_dict(),
                "aggregator": self.aggregator.state_dict(),
                "versions": {"version": self.version, "start": self._start,
                             "last_due": self._last_due,
                             "minibatches_out": self._minibatches_out,
                             "rollbacks_pending": self._rollbacks_pending},
                "evaluation": {"last_evaluated": self._last_evaluated,
                               "pending": self._pending, "running": self._running,
                               "begun": self._begun,
                               "epochs_ended": sorted(self._epochs_ended)},
                **({"lr_plateau": self.metric_schedule.state_dict()}
                   if self.metric_schedule is not None else {}),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (a core built from the same spec and data)."""
        with self._lock:
            state = json.loads(json.dumps(state))  # a private copy
            task_state.restore(self.tm, state["tasks"], self.tm._clock())
            self.replicas.load_state_dict(state["replicas"])
            self.protocols.load_state_dict(state.get("protocols"))
            self.report.load_state_dict(state["report"])
            self.aggregator.load_state_dict(state["aggregator"])
            v = state["versions"]
            self.version, self._start = int(v["version"]), int(v["start"])
            self._last_due, self._minibatches_out = int(v["last_due"]), int(v["minibatches_out"])
            self._rollbacks_pending = int(v.get("rollbacks_pending", 0))
            e = state["evaluation"]
            self._last_evaluated = e["last_evaluated"]
            self._pending, self._running, self._begun = e["pending"], e["running"], e["begun"]
            self._epochs_ended = set(e["epochs_ended"])
            if self.metric_schedule is not None:
                self.metric_schedule.load_state_dict(state.get("lr_plateau"))


def start_version_of(path: str) -> int:
    """The model version of a checkpoint, or of a job's output with its exported
    ``model.pt`` (the version its report names), to start from."""
    from elasticdl.checkpoint import paths

    exported = exported_model_version(path)
    if exported is not None:
        return exported
    return paths.version_of(paths.resolve(path))


def report_for(spec: Any, tm: Optional[TaskManager] = None, **fields: Any) -> JobReport:
    """The job report of ``spec`` (every mode builds it here); ``tm`` gives the
    dataset sizes, ``fields`` e.g. a failure at start-up."""
    from elasticdl.common.strategy import entry_for

    local = spec.distribution_strategy == Strategy.LOCAL
    sizes: dict[str, Any] = {} if tm is None else {"training_records": tm.training_records,
                                   "validation_records": tm.evaluation_records,
                                   "prediction_records": tm.prediction_records}
    return JobReport(spec.job_name, spec.distribution_strategy,
                     "local" if local else spec.cluster, 1 if local else spec.num_workers,
                     entry_for(spec.distribution_strategy).num_ps(spec), job_type=spec.job_type,
                     **sizes, **fields)
