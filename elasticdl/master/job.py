"""The job core: every decision of a job, in one object with serialisable state.

:class:`JobCore` owns the :class:`TaskManager` (tasks, per-epoch ledger), the
:class:`EvaluationAggregator`, the :class:`Schedule`, the :class:`JobReport`,
the job's model version and its bound (:class:`ModelVersions`), the
evaluation barrier (:class:`EvaluationBarrier`) and the relaunch bookkeeping
(:class:`ReplicaBook`). The Local strategy runs it in process behind
``LocalTaskSource``; the gRPC master runs it behind its servicer, and the
:class:`JobController` only applies its decisions on the cluster.
:meth:`JobCore.state_dict` is a JSON-able dict a restarted master can
continue from (:meth:`JobCore.load_state_dict`).

Its parts share one lock and journal every change before returning (the rule:
:mod:`elasticdl.master.core_base`); the journaling is the mixin
:class:`~elasticdl.master.job_journal.Journaled`, the recovery transitions the
mixin :class:`~elasticdl.master.recovery.Recovery`. A job's core is built from
its spec in :mod:`elasticdl.master.job_factory`.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

from elasticdl.common.enums import JobType
from elasticdl.common.job_report import JobReport
from elasticdl.common.schedule import Schedule
from elasticdl.common.task import Task, TaskType
from elasticdl.master import task_state
from elasticdl.master.core_types import Metric, Refusal, TaskResult
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.evaluation_barrier import EvaluationBarrier
from elasticdl.master.listeners import JobListeners
from elasticdl.master.lr_plateau import MetricSchedule
from elasticdl.master.protocols import ProtocolBook
from elasticdl.master.recovery import Recovery
from elasticdl.master.replicas import ReplicaBook
from elasticdl.master.task_manager import TaskManager
from elasticdl.master.training_health import HealthStatus, LossHealth
from elasticdl.master.versions import ModelVersions, VersionError

__all__ = ["JobCore", "Metric", "Refusal", "TaskResult", "VersionError"]

logger = logging.getLogger(__name__)


class JobCore(Recovery):
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
        super().__init__()
        self.tm = task_manager
        self.report = report
        self.schedule = schedule or Schedule()
        self.minibatch_size = minibatch_size
        self.job_type = job_type
        self.aggregator = aggregator or EvaluationAggregator()
        self.replicas = ReplicaBook()
        self.protocols = ProtocolBook()   # open recovery protocols (see recovery.py)
        self.versions = ModelVersions(start_version)
        self.listeners = JobListeners()
        self.evaluations = EvaluationBarrier(task_manager, self.aggregator, report,
                                             self.notify, manage_evaluations)
        # judges the training loss the workers report (None: --on_divergence=off)
        self.health: Optional[LossHealth] = None
        # the readers of the job's data by task type: the byte spans tasks carry
        # (master/servicer.py); set by job_factory.core_from_spec
        self.task_readers: dict[Any, Any] = {}
        self._begun = False
        # called with the core after each refresh_report (the job history writer)
        self.refresh_hooks: list[Any] = []
        self._init_journal(task_manager)
        task_manager.evaluation_done_callbacks.append(self.evaluations.on_done)
        if manage_evaluations:
            task_manager.epoch_end_callbacks.append(self._on_epoch_end)
            # an epoch is a real boundary, as in one process: epoch-end evaluations
            # see exactly that epoch, and per-epoch LR schedules change between epochs
            task_manager.epoch_barrier = job_type == JobType.TRAIN

    @classmethod
    def for_tasks(cls, task_manager: TaskManager,
                  aggregator: Optional[EvaluationAggregator] = None, **kwargs: Any) -> JobCore:
        """A core around a bare task manager that leaves evaluations to its caller
        (tests, benchmarks, tools); a job's core: :func:`job_factory.core_from_spec`."""
        kwargs.setdefault("manage_evaluations", False)
        return cls(task_manager, JobReport("job", "", "", 1, 0), aggregator=aggregator,
                   **kwargs)

    @property
    def version(self) -> int:
        """The job's model version (the newest a worker reported within the bound)."""
        return self.versions.version

    @property
    def metric_schedule(self) -> Optional[MetricSchedule]:
        """A metric-driven LR schedule (ReduceLROnPlateau), stepped at each evaluation."""
        return self.evaluations.metric_schedule

    @metric_schedule.setter
    def metric_schedule(self, schedule: Optional[MetricSchedule]) -> None:
        self.evaluations.metric_schedule = schedule

    # ------------------------------------------------------------- versions
    def start_at_version(self, version: int) -> None:
        """The model the job starts from has ``version`` (a restored checkpoint)."""
        with self._lock:
            self.versions.start_at(version)
            self._log("start_at", version=version)

    def version_bound(self) -> int:
        """The highest model version a worker may report now (see :mod:`versions`)."""
        with self._lock:
            return self.versions.bound(self.tm.rollback_version)

    def on_version(self, worker_id: int, version: int) -> None:
        """A worker's model version. Raises VersionError above :meth:`version_bound`."""
        with self._lock:
            v = self.versions
            before = (v.version, v.last_due, self.evaluations.pending)
            self._on_version(worker_id, version)
            if before != (v.version, v.last_due, self.evaluations.pending):
                self._log("version", w=worker_id, version=version)

    def _on_version(self, worker_id: int, version: int) -> None:
        v, rollback_version = self.versions, self.tm.rollback_version
        rolling_back = version > v.bound(rollback_version) and (
            v.rollbacks_pending > 0 or self.rolling_back())
        if not v.accept(worker_id, version, rollback_version, rolling_back):
            return
        if self.job_type == JobType.TRAIN and self.schedule.eval_due(version, v.last_due):
            v.last_due = version
            self.evaluations.request("periodic", None, version)

    # ---------------------------------------------------------------- tasks
    def begin(self) -> None:
        """Start the job (an evaluate job queues its one evaluation). Idempotent."""
        with self._lock:
            if not self._begun and self.job_type == JobType.EVALUATE:
                self.evaluations.request("evaluate", None, self.version)
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
        self.evaluations.maybe_start(self.version)
        task = self.tm.get(worker_id, task_type, request_id, reassign)
        if task.type == TaskType.TRAINING:
            self.versions.handed_out(task.num_records, self.minibatch_size)
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
        if self.health is not None and task is not None and worker_id in holders and \
                task.type == TaskType.TRAINING:
            c = counters or {}
            self.health.judge_task(success, error, loss, task.num_records, self.version,
                                   collapsed=(int(c.get("collapsed_records", 0)),
                                              int(c.get("collapsed_at_version", 0)),
                                              int(c.get("alive_at_version", -1))))
        self.evaluations.maybe_start(self.version)
        return trained

    def health_verdict(self) -> Optional[tuple[HealthStatus, str]]:
        """The detector's unhealthy verdict ``(status, reason)``, or None (healthy, off)."""
        with self._lock:
            h = self.health
            return None if h is None or h.healthy else (h.status, h.reason)

    def finish_health(self) -> None:
        """Training ended: the detector judges its open window and the final model
        (:meth:`LossHealth.finish`); before the job's terminal status is decided."""
        with self._lock:
            if self.health is not None:
                self.health.finish()

    def restart_health(self) -> None:
        """Judge the loss afresh (after a divergence rollback)."""
        with self._lock:
            if self.health is not None:
                self.health.restart()
                self._log("health_restart")

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

    def recover_tasks(self, worker_id: int) -> list[Task]:
        """Re-queue what a dead worker held."""
        with self._lock, self._at() as t:
            lost = self.tm.recover_tasks(worker_id)
            self.evaluations.maybe_start(self.version)
            self._log("recover", t=t, w=worker_id)
            return lost

    def lr_reductions(self) -> int:
        """Reductions of a metric-driven LR schedule decided so far (0: none)."""
        with self._lock:
            ms = self.metric_schedule
            return ms.reductions() if ms is not None else 0

    def held_task(self, task_id: int) -> tuple[Optional[Task], frozenset[int]]:
        return self.tm.held_task(task_id)

    def task_exists(self, task_id: int) -> bool:
        return self.tm.task_exists(task_id)

    def has_worked(self, worker_id: int) -> bool:
        return self.tm.has_worked(worker_id)

    def finished(self) -> bool:
        """Every task done, no evaluation due or running, no PS rollback open."""
        with self._lock:
            return self.evaluations.idle() and self.tm.finished() and \
                not self.rolling_back()

    # ----------------------------------------------------------- evaluation
    def _on_epoch_end(self, epoch: int) -> None:
        if self.job_type != JobType.TRAIN:
            return
        with self._lock:
            self.evaluations.on_epoch_end(epoch, self.version)

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
        if self.health is not None:
            with self._lock:
                report.extra["training_health"] = self.health.report()
        for hook in self.refresh_hooks:
            hook(self)
        return report

    # ------------------------------------------------------------ listeners
    def add_listener(self, listener: Any) -> None:
        """``listener`` hears of the job's events (see :class:`JobListeners`)."""
        self.listeners.add(listener)

    def notify(self, event: str, **fields: Any) -> None:
        """Tell every listener of ``event`` (see :meth:`JobListeners.notify`)."""
        self.listeners.notify(event, **fields)

    # ---------------------------------------------------------------- state
    def state_dict(self, defer: bool = False) -> dict[str, Any]:
        """The whole job state as a JSON-able dict (``defer``: its per-task lists
        as :class:`task_state.Deferred`, made by :func:`task_state.resolve`
        outside the lock)."""
        with self._lock:
            ms = self.metric_schedule
            return {
                "tasks": task_state.dump(self.tm, defer),
                "replicas": self.replicas.state_dict(),
                "protocols": self.protocols.state_dict(),
                "report": self.report.state_dict(),
                "aggregator": self.aggregator.state_dict(),
                "versions": self.versions.state_dict(),
                "evaluation": {**self.evaluations.state_dict(), "begun": self._begun},
                **({"lr_plateau": ms.state_dict()} if ms is not None else {}),
                **({"health": self.health.state_dict()} if self.health is not None else {}),
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
            self.versions.load_state_dict(state["versions"])
            self.evaluations.load_state_dict(state["evaluation"])
            self._begun = state["evaluation"]["begun"]
            if self.metric_schedule is not None:
                self.metric_schedule.load_state_dict(state.get("lr_plateau"))
            if self.health is not None:
                self.health.load_state_dict(state.get("health"))
