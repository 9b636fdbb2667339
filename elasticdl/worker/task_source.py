"""Where a worker's tasks come from: the master over gRPC, or the job core in
process (Local strategy). Both implement :class:`TaskSource`, so the worker's
task loop is one piece of code for every strategy."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Optional, Union

from elasticdl.common.task import Task, TaskType
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.job import JobCore
from elasticdl.master.task_manager import TaskManager

Metric = tuple[str, float, int]  # name, value, weight (samples)


class TaskSource(ABC):
    """The master as a worker sees it."""

    @abstractmethod
    def get_task(self, task_type: Optional[TaskType] = None) -> Task:
        """Next task; ``TaskType.WAIT`` means ask again soon, ``NONE`` means stop.

        Raises:
            ConnectionError: the master cannot be reached within its timeout.
        """

    @abstractmethod
    def report_task(self, task: Task, error: str = "", traceback: str = "",
                    fatal: bool = False, counters: Optional[Mapping[str, int]] = None,
                    loss: Optional[float] = None, learning_rate: Optional[float] = None
                    ) -> None:
        """Report a task done (empty ``error``) or failed, with ``counters`` such as
        ``records_applied`` (what the PS applied of it) or ``nonfinite_steps_skipped``,
        the worker's model version after it and, for a training task, the mean loss
        of its steps and the learning rate its last step was applied with."""

    @abstractmethod
    def report_evaluation(self, task: Task, metrics: Sequence[Metric],
                          states: bytes = b"") -> None:
        """Report one evaluation task's metrics and its stateful metrics' serialised
        ``states``, or a finalize task's merged values (before :meth:`report_task`)."""

    def report_version(self, version: int) -> None:  # noqa: B027 - optional hook
        """Tell the master the worker's model version (progress; evaluations are
        the master's decision)."""


class LocalTaskSource(TaskSource):
    """The job core in process (Local strategy).

    Args:
        core: the job's :class:`JobCore`; a bare :class:`TaskManager` (tests,
            tools) is wrapped in one that leaves evaluations to the caller.
        version: the worker's model version, sent with every task result.
    """

    def __init__(self, core: Union[JobCore, TaskManager],
                 aggregator: Optional[EvaluationAggregator] = None, worker_id: int = 0,
                 version: Optional[Callable[[], int]] = None):
        if isinstance(core, TaskManager):
            core = JobCore.for_tasks(core, aggregator)
        self.core = core
        self.worker_id = worker_id
        self.version = version

    def get_task(self, task_type: Optional[TaskType] = None) -> Task:
        task = self.core.get(self.worker_id, task_type)
        if task.type == TaskType.EVALUATION_FINALIZE:  # as the servicer attaches them
            task = replace(task, metric_states=self.core.evaluation_states(task.model_version))
        return task

    def report_task(self, task: Task, error: str = "", traceback: str = "",
                    fatal: bool = False, counters: Optional[Mapping[str, int]] = None,
                    loss: Optional[float] = None, learning_rate: Optional[float] = None
                    ) -> None:
        version = self.version() if self.version is not None else None
        self.core.report_task(task.task_id, self.worker_id, not error, error, traceback,
                              fatal, counters=counters, model_version=version, loss=loss,
                              learning_rate=learning_rate)

    def report_evaluation(self, task: Task, metrics: Sequence[Metric],
                          states: bytes = b"") -> None:
        self.core.report_evaluation(task.task_id, task.model_version, metrics, states)

    def report_version(self, version: int) -> None:
        self.core.on_version(self.worker_id, version)
