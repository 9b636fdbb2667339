"""Asking the master for tasks, and cutting a task's records into minibatches.

:class:`TaskPoller` is the one ``get_task`` loop of every worker runtime (the
task loop, the allreduce member after training, the elastic dataset): while
the master says ``WAIT`` it pauses ``wait_s`` between asks and gives up with
:class:`TimeoutError` once it has been told to wait for ``max_wait_s`` in a
row. :func:`minibatch_slice` is the one rule for which records of a task form
its k-th minibatch. :class:`LeasedTasks` is the worker's lease buffer: several
tasks per call, results batched into the next call.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from elasticdl.common.task import Task, TaskType
from elasticdl.worker.task_source import Metric, TaskSource

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


#: the most tasks a worker leases at once by default
DEFAULT_MAX_LEASE = 16


class LeasedTasks(TaskSource):
    """A lease buffer in front of a source that leases (:class:`MasterClient`):
    several tasks per ``get_tasks`` call and the results of finished tasks sent
    with the next one, so a worker of short tasks makes one call per lease
    instead of two per task.

    The lease size adapts to the task duration: about ``lease_s`` seconds of work
    (from a moving average of the time between asks), at least 1, at most
    ``max_lease``; tasks of ``lease_s`` or longer go one per call as before.
    Results wait at most about ``lease_s`` (an older one is sent on its own);
    a failure is sent at once with those waiting. Ask only with what the caller
    got reported: the lease contract (:mod:`elasticdl.master.leases`) is that the
    worker holds nothing when it asks.

    Args:
        source: has ``get_tasks(task_type, max_tasks, reports)``,
            ``report_tasks(reports)`` and ``report_request(task, ...)``.
    """

    def __init__(self, source: Any, lease_s: float, max_lease: int = DEFAULT_MAX_LEASE,
                 clock: Callable[[], float] = time.monotonic):
        if lease_s <= 0 or max_lease < 1:
            raise ValueError(f"need lease_s > 0 and max_lease >= 1, got {lease_s}, "
                             f"{max_lease}")
        self.source = source
        self.lease_s = lease_s
        self.max_lease = max_lease
        self._clock = clock
        self._buffer: deque[Task] = deque()
        self._reports: list[Any] = []
        self._oldest: Optional[float] = None   # when the oldest waiting result was made
        self._handed: Optional[float] = None   # when the last real task went out
        self.task_s: Optional[float] = None    # moving average of a task's duration
        self.calls = 0                         # get_tasks calls made

    @staticmethod
    def supported(source: Any) -> bool:
        return all(callable(getattr(source, n, None))
                   for n in ("get_tasks", "report_tasks", "report_request"))

    def lease_size(self) -> int:
        """Tasks to ask for now (1 until a task duration is known)."""
        if self.task_s is None:
            return 1
        return max(1, min(self.max_lease, int(self.lease_s / max(self.task_s, 1e-6))))

    @property
    def leased(self) -> int:
        """Tasks leased and not yet handed to the caller."""
        return len(self._buffer)

    def peek(self) -> Optional[Task]:
        """The task :meth:`get_task` hands out next, if it is leased already."""
        return self._buffer[0] if self._buffer else None

    def get_task(self, task_type: Optional[TaskType] = None) -> Task:
        now = self._clock()
        if self._handed is not None:   # the caller is done with the last task
            took = now - self._handed
            self.task_s = took if self.task_s is None else 0.7 * self.task_s + 0.3 * took
            self._handed = None
        if not self._buffer:
            reports, self._reports, self._oldest = self._reports, [], None
            self.calls += 1
            self._buffer.extend(self.source.get_tasks(task_type, self.lease_size(), reports))
        elif self._overdue():
            self.flush()
        task = self._buffer.popleft()
        if task.type not in (TaskType.WAIT, TaskType.NONE):
            self._handed = self._clock()
        return task

    def report_task(self, task: Task, error: str = "", traceback: str = "",
                    fatal: bool = False, counters: Optional[Mapping[str, int]] = None,
                    loss: Optional[float] = None, learning_rate: Optional[float] = None
                    ) -> None:
        self._reports.append(self.source.report_request(task, error, traceback, fatal,
                                                        counters, loss, learning_rate))
        if self._oldest is None:
            self._oldest = self._clock()
        if error or self._overdue():
            self.flush()

    def _overdue(self) -> bool:
        return self._oldest is not None and self._clock() - self._oldest >= self.lease_s

    def flush(self) -> None:
        """Send the results waiting (a no-op when none are)."""
        if self._reports:
            reports, self._reports, self._oldest = self._reports, [], None
            self.source.report_tasks(reports)

    def report_evaluation(self, task: Task, metrics: Sequence[Metric],
                          states: bytes = b"") -> None:
        self.source.report_evaluation(task, metrics, states)

    def report_version(self, version: int) -> None:
        self.source.report_version(version)
