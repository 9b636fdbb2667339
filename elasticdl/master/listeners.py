"""The job core's listeners: what they hear of the job's events
(:class:`JobListener`) and who hears it (:class:`JobListeners`)."""

from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger("elasticdl.master.job")


class JobListener:
    """What a job core tells its listeners (override what you need).

    ``version``: the job's model version when it happened (never goes back), the
    x axis of every TensorBoard series except evaluations (the evaluated version).
    """

    def on_training_task(self, epoch: int, records: int, loss: Optional[float],
                         learning_rate: Optional[float], version: int) -> None:
        """A training task of ``epoch`` finished: its mean loss over ``records`` and
        the learning rate its last step was applied with (either may be None)."""

    def on_evaluation(self, version: int, metrics: dict[str, float]) -> None:
        """The evaluation of model ``version`` completed with ``metrics``."""

    def on_epoch_end(self, epoch: int, version: int) -> None:
        """Every training task of ``epoch`` is done."""

    def on_relaunch(self, replica: str, new_replica: str, reason: str, version: int) -> None:
        """``replica`` ended (``reason``) and ``new_replica`` replaces it."""

    def on_replica(self, kind: str, index: int, alive: bool) -> None:
        """Replica ``kind`` ("worker", "ps") ``index`` started (or was adopted) or ended."""


class JobListeners:
    """Listeners of the job core, told of events by method name."""

    def __init__(self) -> None:
        self._listeners: list[Any] = []

    def add(self, listener: Any) -> None:
        """``listener`` hears of the job's events by method name (see
        :class:`JobListener`): ``on_training_task``, ``on_evaluation``,
        ``on_epoch_end``, ``on_relaunch``. Called under the core's lock (from gRPC
        handlers): a listener returns at once (queues, never blocks)."""
        self._listeners.append(listener)

    def notify(self, event: str, **fields: Any) -> None:
        """Tell every listener of ``event``; a listener's error is logged, never
        fails the job (observability must not stop training)."""
        for listener in self._listeners:
            try:
                getattr(listener, event)(**fields)
            except Exception:  # noqa: BLE001 - logged with its traceback
                logger.exception("job listener %r failed on %s", listener, event)
