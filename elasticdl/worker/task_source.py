"""Where a worker's tasks come from: the master over gRPC
(:class:`~elasticdl.worker.master_client.MasterClient`), or the job core in process (Local
strategy, :class:`elasticdl.local.task_source.LocalTaskSource`). Both implement
:class:`TaskSource`, so the worker's task loop is one piece of code for every strategy."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Optional

from elasticdl.common.task import Task, TaskType

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
