"""The job core's listeners: who hears of the job's events."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("elasticdl.master.job")


class JobListeners:
    """Listeners of the job core, told of events by method name."""

    def __init__(self) -> None:
        self._listeners: list[Any] = []

    def add(self, listener: Any) -> None:
        """``listener`` hears of the job's events by method name (see
        :class:`elasticdl.master.observability.JobListener`): ``on_training_task``,
        ``on_evaluation``, ``on_epoch_end``, ``on_relaunch``. Called under the core's
        lock (from gRPC handlers): a listener returns at once (queues, never blocks)."""
        self._listeners.append(listener)

    def notify(self, event: str, **fields: Any) -> None:
        """Tell every listener of ``event``; a listener's error is logged, never
        fails the job (observability must not stop training)."""
        for listener in self._listeners:
            try:
                getattr(listener, event)(**fields)
            except Exception:  # noqa: BLE001 - logged with its traceback
                logger.exception("job listener %r failed on %s", listener, event)
