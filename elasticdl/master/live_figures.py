"""The latest training figures of a job, kept by a listener of its core: records
per second over a sliding window (:class:`RateMeter`) and the last training
task's loss and learning rate (:class:`LiveFigures`, read by the Prometheus
endpoint). No torch.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Optional

from elasticdl.master.listeners import JobListener


class RateMeter:
    """Records per second over a sliding window of ``window_s`` seconds, counted in
    buckets of a thirtieth of the window (an add costs the same at any rate)."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._bucket_s = window_s / 30
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: deque[list[float]] = deque()   # [bucket start, records]
        self._start = clock()

    def _expire(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] < now - self.window_s:
            self._buckets.popleft()

    def add(self, records: int) -> None:
        with self._lock:
            now = self._clock()
            last = self._buckets[-1] if self._buckets else None
            if last is not None and now - last[0] < self._bucket_s:
                last[1] += records
            else:
                self._buckets.append([now, records])
                self._expire(now)

    def rate(self) -> float:
        """Records per second over the window (over the time since the meter
        started while that is shorter than the window)."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            span = min(self.window_s, now - self._start)
            total = sum(r for _, r in self._buckets)
            return total / span if span > 0 else 0.0


class LiveFigures(JobListener):
    """The latest training figures (for the Prometheus endpoint): the last
    training task's loss and learning rate, records per second, epoch."""

    def __init__(self, window_s: float = 30.0):
        self.loss: Optional[float] = None
        self.learning_rate: Optional[float] = None
        self.epoch: Optional[int] = None
        self.meter = RateMeter(window_s)

    def on_training_task(self, epoch: int, records: int, loss: Optional[float],
                         learning_rate: Optional[float], version: int) -> None:
        self.meter.add(records)
        self.epoch = epoch
        if loss is not None:
            self.loss = float(loss)
        if learning_rate is not None:
            self.learning_rate = float(learning_rate)
