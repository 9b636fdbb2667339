"""Reading the next leased task's records while the current task trains.

A worker that leases tasks (:class:`~elasticdl.worker.poller.LeasedTasks`) knows its
next task before the current one ends. :class:`ReadAhead` reads that task's records in
one background thread while the current task trains, so a read's latency (a ranged GET
from object storage: a first byte in tens of milliseconds, a task's training often
less) overlaps training instead of adding to it. Only readers that read a task at once
(the built-in file readers and ``custom_data_reader``) are read ahead; a module's
``dataset`` loads per minibatch and has its own DataLoader workers.

Reading has no side effect, so exactly-once accounting is untouched: the records a task
trains are those its own range names, read ahead or not. Reads never overlap: a read of
a task that turns out not to be the next one (the lease was given back, a retry came
first) is waited for and dropped before the worker reads anything else, so a reader
need not be thread-safe, only usable from another thread. A read-ahead's error is
raised when its task is run, exactly as its own read would have raised it. Cost: one
more task's records in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from elasticdl.common.task import Task
from elasticdl.worker.minibatches import TaskRecords

logger = logging.getLogger(__name__)


def _same(a: Task, b: Task) -> bool:
    return (a.task_id, a.type, a.shard_name, a.start, a.end) == \
        (b.task_id, b.type, b.shard_name, b.start, b.end)


class ReadAhead:
    """One task's records read in a background thread (module doc)."""

    def __init__(self, read: Callable[[Task], TaskRecords]):
        self._read = read
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[tuple[Task, Future[TaskRecords]]] = None
        self.hits = 0      # tasks whose records were read ahead
        self.dropped = 0   # reads ahead of a task that was not the next one run

    def start(self, task: Task) -> None:
        """Read ``task``'s records now, in the background (one read at a time)."""
        if self._pending is not None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="read-ahead")
        self._pending = (task, self._pool.submit(self._read, task))

    def take(self, task: Task) -> Optional[TaskRecords]:
        """``task``'s records if they were read ahead (a failed read raises its error
        here), else None, once any read of another task has ended."""
        if self._pending is None:
            return None
        ahead, future = self._pending
        self._pending = None
        if _same(ahead, task):
            self.hits += 1
            return future.result()
        self.dropped += 1
        try:
            future.result()
        except Exception as e:  # noqa: BLE001 - not this task's read; it reads its own
            logger.debug("dropped read-ahead of task %d failed: %s", ahead.task_id, e)
        return None

    def close(self) -> None:
        """Wait for a read under way, then stop the thread."""
        if self._pending is not None:
            future, self._pending = self._pending[1], None
            try:
                future.result()
            except Exception:  # noqa: BLE001 - a read nobody will run now
                pass
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
