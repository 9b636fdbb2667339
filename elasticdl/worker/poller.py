"""Asking the master for tasks, and cutting a task's records into minibatches.

:class:`TaskPoller` is the one ``get_task`` loop of every worker runtime (the
task loop, the allreduce member after training, the elastic dataset): while
the master says ``WAIT`` it pauses ``wait_s`` between asks and gives up with
:class:`TimeoutError` once it has been told to wait for ``max_wait_s`` in a
row. :func:`minibatch_slice` is the one rule for which records of a task form
its k-th minibatch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Optional

from elasticdl.common.task import Task, TaskType
from elasticdl.worker.task_source import TaskSource

logger = logging.getLogger(__name__)

#: the longest a worker waits, by default, for the master to have a task
DEFAULT_MAX_WAIT_S = 3600.0


def minibatch_count(num_records: int, minibatch_size: int) -> int:
    """How many minibatches ``num_records`` records make (the last may be short).

    Raises:
        ValueError: ``minibatch_size`` is not positive.
    """
    if minibatch_size <= 0:
        raise ValueError(f"minibatch_size must be > 0, got {minibatch_size}")
    return -(-num_records // minibatch_size)


def minibatch_slice(index: int, num_records: int, minibatch_size: int) -> slice:
    """The records of the ``index``-th (0-based) minibatch of a task.

    Raises:
        ValueError: ``minibatch_size`` is not positive or ``index`` is out of range.
    """
    if not 0 <= index < minibatch_count(num_records, minibatch_size):
        raise ValueError(f"minibatch {index} out of range for {num_records} records "
                         f"in minibatches of {minibatch_size}")
    start = index * minibatch_size
    return slice(start, min(start + minibatch_size, num_records))


class TaskPoller:
    """Polls a :class:`TaskSource` with a bounded wait.

    Args:
        source: the master (or an in-process task manager).
        wait_s: pause between asks while the master says WAIT.
        max_wait_s: how long in a row a worker may be told to wait before
            :meth:`poll` raises :class:`TimeoutError`.
        clock / sleep: injectable for tests.
    """

    def __init__(self, source: TaskSource, wait_s: float = 0.2,
                 max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if wait_s < 0 or max_wait_s <= 0:
            raise ValueError(f"need wait_s >= 0 and max_wait_s > 0, got {wait_s}, "
                             f"{max_wait_s}")
        self.source = source
        self.wait_s = wait_s
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._sleep = sleep
        self._waiting_since: Optional[float] = None

    @property
    def waited_s(self) -> float:
        """How long the master has been saying WAIT in a row (0 when it is not)."""
        return 0.0 if self._waiting_since is None else self._clock() - self._waiting_since

    def poll(self, task_type: Optional[TaskType] = None,
             while_waiting: Optional[Callable[[], bool]] = None) -> Task:
        """Ask once. On WAIT, run ``while_waiting`` (work a waiting worker does,
        e.g. an idle allreduce round; it returns False when that work made
        progress, and then the poller does not pause), else pause ``wait_s``.
        Returns the task, WAIT included.

        Raises:
            TimeoutError: told to wait for ``max_wait_s`` in a row, while idle.
            ConnectionError: the source cannot be reached (from ``get_task``).
        """
        task = self.source.get_task(task_type)
        if task.type != TaskType.WAIT:
            self._waiting_since = None
            return task
        now = self._clock()
        if self._waiting_since is None:
            self._waiting_since = now
        idle = while_waiting() if while_waiting is not None else True
        if idle:
            waited = now - self._waiting_since
            if waited >= self.max_wait_s:
                raise TimeoutError(f"told to wait for {waited:.0f} s (max wait "
                                   f"{self.max_wait_s:.0f} s); giving up")
            self._sleep(self.wait_s)
        return task

    def next_task(self, task_type: Optional[TaskType] = None) -> Task:
        """The next task that is not WAIT (``NONE`` means stop).

        Raises:
            TimeoutError: told to wait for ``max_wait_s`` in a row.
            ConnectionError: the source cannot be reached.
        """
        while True:
            task = self.poll(task_type)
            if task.type != TaskType.WAIT:
                return task
