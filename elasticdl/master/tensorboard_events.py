"""TensorBoard scalars from the master, without torch: tensorboard's own
``EventFileWriter`` and protos behind a bounded queue and one writer thread.

:meth:`ScalarEventWriter.add_scalar` never blocks (the job core calls its
listeners from gRPC handlers): when the queue is full the scalar is dropped and
counted (``dropped``). Rare scalars that must not be lost to a burst of
frequent ones (evaluations, epochs, relaunches: ``keep=True``) go to a separate
queue the thread drains first. The thread writes events, flushes the file every
``flush_secs`` and on :meth:`flush` / :meth:`close`. It drains about 15-20k
events/s on one core; a master answers ~1.2k task reports/s (2-3 scalars each).

Tags (see docs/observability.md): ``train/loss``, ``train/learning_rate``,
``train/records_per_second``, ``eval/<metric>``, ``job/relaunches``,
``job/epochs_completed``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Optional

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from elasticdl.master.observability import JobListener, RateMeter

logger = logging.getLogger(__name__)

_CLOSE = object()
_WAKE = object()


class ScalarEventWriter:
    """Scalars into one new event file in ``logdir`` (a restarted master adds
    its own file next to the earlier ones; TensorBoard reads them all)."""

    def __init__(self, logdir: str, max_queue: int = 4096, flush_secs: float = 5.0):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.logdir = logdir
        self.flush_secs = flush_secs
        self.dropped = 0
        self._queue: queue.Queue[Any] = queue.Queue(max_queue)
        self._kept: deque[Any] = deque()
        self._max_kept = max_queue
        self._kept_lock = threading.Lock()
        self._closed = False
        self._writer = EventFileWriter(logdir, max_queue_size=1024, flush_secs=3600,
                                       filename_suffix=".elasticdl")
        self._thread = threading.Thread(target=self._run, name="tensorboard-writer",
                                        daemon=True)
        self._thread.start()

    @property
    def path(self) -> str:
        return str(self._writer._file_name)

    def add_scalar(self, tag: str, value: float, step: int,
                   wall_time: Optional[float] = None, keep: bool = False) -> bool:
        """Queue one scalar; False (and ``dropped`` + 1) when its queue is full or
        the writer is closed. ``keep``: a rare scalar, queued apart from the
        frequent ones (written first). Never blocks."""
        if self._closed:
            return self._drop()
        event = event_pb2.Event(
            wall_time=time.time() if wall_time is None else wall_time, step=int(step),
            summary=summary_pb2.Summary(value=[summary_pb2.Summary.Value(
                tag=tag, simple_value=float(value))]))
        if keep:
            with self._kept_lock:
                if len(self._kept) >= self._max_kept:
                    return self._drop()
                self._kept.append(event)
            try:
                self._queue.put_nowait(_WAKE)
            except queue.Full:
                pass  # the thread is busy: it takes kept events before the next one
            return True
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            return self._drop()
        return True

    def _drop(self) -> bool:
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 1000 == 0:
            logger.warning("TensorBoard writer queue full or closed: %d scalar(s) dropped so "
                           "far", self.dropped)
        return False

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Write what is queued now and flush the file; False if that took longer
        than ``timeout_s`` (or the writer is closed)."""
        if self._closed or not self._thread.is_alive():
            return False
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, flush and close the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(_CLOSE, timeout=timeout_s)
        except queue.Full:
            logger.warning("TensorBoard writer did not drain its queue in %.0f s", timeout_s)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        next_flush = time.monotonic() + self.flush_secs
        while True:
            try:
                item = self._queue.get(timeout=max(next_flush - time.monotonic(), 0.01))
            except queue.Empty:
                item = None
            while True:
                with self._kept_lock:
                    kept = self._kept.popleft() if self._kept else None
                if kept is None:
                    break
                self._writer.add_event(kept)
            if item is _CLOSE:
                self._writer.close()
                return
            if isinstance(item, event_pb2.Event):
                self._writer.add_event(item)
            if isinstance(item, threading.Event) or time.monotonic() >= next_flush:
                self._writer.flush()
                next_flush = time.monotonic() + self.flush_secs
            if isinstance(item, threading.Event):
                item.set()


class TensorBoardListener(JobListener):
    """The job core's events as scalars. Counts continue from the core's state
    (a restarted master goes on where the journal left off)."""

    def __init__(self, writer: ScalarEventWriter, core: Any, rate_interval_s: float = 2.0):
        self.writer = writer
        self.rate_interval_s = rate_interval_s
        self._meter = RateMeter(window_s=max(rate_interval_s * 5, 10.0))
        self._last_rate = time.monotonic()
        self.relaunches = len(core.report.relaunches)
        total = core.tm.training_records
        self.epochs_completed = sum(1 for e in core.tm.epochs_report()
                                    if total and e["records_completed"] >= total)
        writer.add_scalar("job/relaunches", self.relaunches, core.version, keep=True)
        writer.add_scalar("job/epochs_completed", self.epochs_completed, core.version,
                          keep=True)

    def on_training_task(self, epoch: int, records: int, loss: Optional[float],
                         learning_rate: Optional[float], version: int) -> None:
        if loss is not None:
            self.writer.add_scalar("train/loss", loss, version)
        if learning_rate is not None:
            self.writer.add_scalar("train/learning_rate", learning_rate, version)
        self._meter.add(records)
        now = time.monotonic()
        if now - self._last_rate >= self.rate_interval_s:
            self._last_rate = now
            self.writer.add_scalar("train/records_per_second", self._meter.rate(), version)

    def on_evaluation(self, version: int, metrics: dict[str, float]) -> None:
        for name, value in sorted(metrics.items()):
            self.writer.add_scalar(f"eval/{name}", value, version, keep=True)

    def on_epoch_end(self, epoch: int, version: int) -> None:
        self.epochs_completed += 1
        self.writer.add_scalar("job/epochs_completed", self.epochs_completed, version,
                               keep=True)

    def on_relaunch(self, replica: str, new_replica: str, reason: str, version: int) -> None:
        self.relaunches += 1
        self.writer.add_scalar("job/relaunches", self.relaunches, version, keep=True)
