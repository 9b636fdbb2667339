"""The minibatches of one task: read, fed, and produced ahead of the step that trains them.

:class:`TaskRecords` is what a task reads: the records of a file reader (built-in or
``custom_data_reader``), read at once, or the index range of a model module's
``dataset`` (:class:`~elasticdl.data.torch_dataset.TorchDatasetReader`), loaded per
minibatch by its DataLoader. Minibatch ``k`` of a task always holds the same records
(:func:`~elasticdl.worker.poller.minibatch_slice`), whichever worker or try makes it,
so exactly-once accounting (skip the minibatches already applied) is unchanged.

:meth:`TaskRecords.produce` yields :class:`Minibatch` es in order, skipping given ones,
through a :class:`~elasticdl.data.prefetch.Prefetcher`: the next minibatch is read and
``feed`` run on it in a background thread while the current one trains. Errors reach
the consumer at that minibatch, with the file (or dataset) and record named.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from elasticdl.common.task import Task
from elasticdl.data.api import DataError, DataReader, MalformedRecordError
from elasticdl.data.prefetch import Prefetcher
from elasticdl.data.torch_dataset import TorchDatasetReader
from elasticdl.worker.poller import minibatch_count, minibatch_slice

logger = logging.getLogger(__name__)

PREFETCH_DEPTH = 2
"""Minibatches made ahead of the one training."""

Feed = Callable[[Any, str], Any]


class FeedError(DataError):
    """``feed`` failed on a minibatch although each record alone was accepted."""


def feed_records(feed: Feed, records: Sequence[Any], mode: str, shard: str,
                 start: int) -> tuple[Any, Any]:
    """Run the user's ``feed``; on failure, find and name the first bad record."""
    try:
        return feed(records, mode)
    except Exception as batch_error:  # user code: re-raised as a structured data error
        for i, record in enumerate(records):
            try:
                feed([record], mode)
            except Exception as e:  # noqa: BLE001 - named and re-raised below
                raise MalformedRecordError(shard, start + i,
                                           f"feed rejected it: {type(e).__name__}: {e}") from e
        raise FeedError(f"feed failed on records {start}-{start + len(records)} of {shard}: "
                        f"{type(batch_error).__name__}: {batch_error}") from batch_error


def feed_collated(feed: Feed, batch: Any, mode: str, shard: str, start: int,
                  stop: int) -> tuple[Any, Any]:
    """Run ``feed`` on a dataset's collated minibatch; a failure names the records."""
    try:
        return feed(batch, mode)
    except DataError:
        raise
    except Exception as e:  # user code: re-raised as a structured data error
        raise FeedError(f"feed failed on the collated records {start}-{stop} of {shard}: "
                        f"{type(e).__name__}: {e}") from e


@dataclass(frozen=True)
class Minibatch:
    """Minibatch ``index`` (0-based) of a task: records ``[start, stop)`` of the task."""

    index: int
    start: int
    stop: int
    features: Any
    labels: Any

    @property
    def size(self) -> int:
        return self.stop - self.start


class TaskRecords:
    """The records of ``task`` from ``reader`` (read now for a file reader).

    Raises:
        DataError / ValueError: the task's range cannot be read.
    """

    def __init__(self, reader: DataReader, task: Task, mode: str, minibatch_size: int,
                 feed: Feed):
        self.task = task
        self.mode = mode
        self.minibatch_size = minibatch_size
        self.feed = feed
        self.dataset: TorchDatasetReader | None = None
        self.records: Sequence[Any] = ()
        if isinstance(reader, TorchDatasetReader):
            reader.check_range(task.shard_name, task.start, task.end)
            self.dataset = reader
            self.num_records = task.end - task.start
        elif task.span is not None and hasattr(reader, "read_span"):
            # the master's index says where the records are: no index here
            self.records = reader.read_span(task.shard_name, task.start, task.end, task.span)
            self.num_records = len(self.records)
        else:
            self.records = reader.read(task.shard_name, task.start, task.end)
            self.num_records = len(self.records)  # a custom reader may return fewer
        self.num_minibatches = minibatch_count(self.num_records, minibatch_size)

    @classmethod
    def of(cls, records: Sequence[Any], task: Task, mode: str, minibatch_size: int,
           feed: Feed) -> TaskRecords:
        """Records already read, e.g. by a caller's own reader."""
        self = cls.__new__(cls)
        self.task, self.mode, self.minibatch_size, self.feed = task, mode, minibatch_size, feed
        self.dataset, self.records, self.num_records = None, records, len(records)
        self.num_minibatches = minibatch_count(self.num_records, minibatch_size)
        return self

    def bounds(self, index: int) -> tuple[int, int]:
        s = minibatch_slice(index, self.num_records, self.minibatch_size)
        return s.start, s.stop

    def make(self, index: int) -> Minibatch:
        """Minibatch ``index``, made in this thread (random access, e.g. a redo)."""
        start, stop = self.bounds(index)
        if self.dataset is not None:
            base = self.task.start
            batch = self.dataset.load(base + start, base + stop)
            return self._fed(index, start, stop, batch)
        features, labels = feed_records(self.feed, self.records[start:stop], self.mode,
                                        self.task.shard_name, self.task.start + start)
        return Minibatch(index, start, stop, features, labels)

    def _fed(self, index: int, start: int, stop: int, batch: Any) -> Minibatch:
        base = self.task.start
        features, labels = feed_collated(self.feed, batch, self.mode, self.task.shard_name,
                                         base + start, base + stop)
        return Minibatch(index, start, stop, features, labels)

    def _iterate(self, indices: Sequence[int]) -> Iterator[Minibatch]:
        if self.dataset is None:
            for k in indices:
                yield self.make(k)
            return
        base = self.task.start
        bounds = [self.bounds(k) for k in indices]
        batches = self.dataset.batches([(base + a, base + b) for a, b in bounds])
        try:
            for k, (a, b), batch in zip(indices, bounds, batches):
                yield self._fed(k, a, b, batch)
        finally:
            batches.close()

    def produce(self, skip: Collection[int] = (), depth: int = PREFETCH_DEPTH
                ) -> Prefetcher[Minibatch]:
        """The minibatches not in ``skip`` (0-based), in order, made ``depth`` ahead in a
        background thread; close it when done (or use ``with``)."""
        indices = [k for k in range(self.num_minibatches) if k not in skip]
        timeout = self.dataset.item_timeout_s if self.dataset is not None else None
        return Prefetcher(self._iterate(indices), depth,
                          name=f"minibatches-task-{self.task.task_id}",
                          item_timeout_s=timeout)
