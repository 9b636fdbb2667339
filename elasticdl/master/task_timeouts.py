"""When a held task counts as a straggler's and goes to another worker.

A policy apart from the task manager's mechanics: it sees task durations and
answers one question, the current timeout.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable


class TaskTimeouts:
    """Args:
        task_timeout_s: a fixed timeout (``--task_timeout_s``); 0 adapts it.
        min_task_timeout_s: the adaptive timeout is three times the median task
            duration seen so far, at least this.
        initial_task_timeout_s: the timeout until three tasks were done (so a
            worker hung in its first task never blocks the job forever).
    """

    def __init__(self, task_timeout_s: float = 0.0, min_task_timeout_s: float = 60.0,
                 initial_task_timeout_s: float = 600.0, history: int = 200):
        self.task_timeout_s = task_timeout_s
        self.min_task_timeout_s = min_task_timeout_s
        self.initial_task_timeout_s = initial_task_timeout_s
        self.durations: deque[float] = deque(maxlen=history)
        self._sorted: list[float] = []    # the same durations, in order (for the median)

    def record(self, duration: float) -> None:
        """A task was done ``duration`` seconds after it was handed out."""
        if len(self.durations) == self.durations.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self.durations[0])]
        self.durations.append(duration)
        bisect.insort(self._sorted, duration)

    def timeout(self) -> float:
        """Seconds a task may be held before it is handed to another worker."""
        if self.task_timeout_s > 0:
            return self.task_timeout_s
        if len(self.durations) < 3:
            return max(self.initial_task_timeout_s, 3 * max(self.durations, default=0.0))
        s, n = self._sorted, len(self._sorted)
        median = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
        return max(self.min_task_timeout_s, 3 * median)

    def restore(self, durations: Iterable[float]) -> None:
        self.durations = deque(durations, maxlen=self.durations.maxlen)
        self._sorted = sorted(self.durations)
