"""Where a worker's tasks come from: the master over gRPC, or an in-process
task manager (Local strategy). Both implement :class:`TaskSource`, so the
worker's task loop is one piece of code for every strategy."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Optional

from elasticdl.common.task import Task, TaskType
from elasticdl.master.evaluation import EvaluationAggregator
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
                    fatal: bool = False, counters: Optional[Mapping[str, int]] = None) -> None:
        """Report a task done (empty ``error``) or failed, with ``counters`` such as
        ``records_applied`` (what the PS applied of it) or ``nonfinite_steps_skipped``."""

    @abstractmethod
    def report_evaluation(self, task: Task, metrics: Sequence[Metric]) -> None:
        """Report one evaluation task's metrics (before :meth:`report_task`)."""

    def report_version(self, version: int) -> None:  # noqa: B027 - optional hook
        """Tell the master the worker's model version (drives evaluation steps)."""


class LocalTaskSource(TaskSource):
    """In-process master for the Local strategy."""

    def __init__(self, task_manager: TaskManager, aggregator: EvaluationAggregator,
                 worker_id: int = 0):
        self.task_manager = task_manager
        self.aggregator = aggregator
        self.worker_id = worker_id

    def get_task(self, task_type: Optional[TaskType] = None) -> Task:
        return self.task_manager.get(self.worker_id, task_type)

    def report_task(self, task: Task, error: str = "", traceback: str = "",
                    fatal: bool = False, counters: Optional[Mapping[str, int]] = None) -> None:
        self.task_manager.report(task.task_id, self.worker_id, not error, error, traceback,
                                 fatal, counters=counters)

    def report_evaluation(self, task: Task, metrics: Sequence[Metric]) -> None:
        self.aggregator.add(task.model_version, task.task_id, metrics)
