"""The job core in process as a worker's :class:`~elasticdl.worker.task_source.TaskSource`
(Local strategy): the wiring of the master's :class:`~elasticdl.master.job.JobCore` to the
worker's task loop, which is why it lives above both."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Optional, Union

from elasticdl.common.task import Task, TaskType
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.job import JobCore
from elasticdl.master.task_manager import TaskManager
from elasticdl.worker.task_source import Metric, TaskSource


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
