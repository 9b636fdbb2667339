"""Aggregating evaluation metrics reported per task into one result per model version.

Each worker reports, for each evaluation task, every metric's value over the
task's records and the number of records. The result for a model version is
the sample-weighted mean over all its tasks. No torch here: the master uses it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, Optional

logger = logging.getLogger(__name__)


class EvaluationAggregator:
    def __init__(self, on_result: Optional[Callable[[int, dict[str, float]], None]] = None):
        self._lock = threading.Lock()
        self._sums: dict[int, dict[str, float]] = {}
        self._weights: dict[int, dict[str, int]] = {}
        self._reported: dict[int, set[int]] = {}
        self.results: dict[int, dict[str, float]] = {}
        self._on_result = on_result

    def add(self, model_version: int, task_id: int,
            metrics: Iterable[tuple[str, float, int]]) -> None:
        """Add one task's ``(name, value, weight)`` metrics; a task counts once."""
        with self._lock:
            seen = self._reported.setdefault(model_version, set())
            if task_id in seen:
                return
            seen.add(task_id)
            sums = self._sums.setdefault(model_version, {})
            weights = self._weights.setdefault(model_version, {})
            for name, value, weight in metrics:
                if weight <= 0:
                    continue
                sums[name] = sums.get(name, 0.0) + float(value) * weight
                weights[name] = weights.get(name, 0) + int(weight)

    def complete(self, model_version: int) -> dict[str, float]:
        """Close a model version's evaluation (all its tasks are done)."""
        with self._lock:
            sums = self._sums.pop(model_version, {})
            weights = self._weights.pop(model_version, {})
            self._reported.pop(model_version, None)
            result = {name: sums[name] / weights[name] for name in sorted(sums)}
            self.results[model_version] = result
        logger.info("evaluation of model version %d: %s", model_version,
                    ", ".join(f"{k}={v:.4f}" for k, v in result.items()))
        if self._on_result is not None:
            self._on_result(model_version, result)
        return result

    def state_dict(self) -> dict[str, Any]:
        """Partial sums of evaluations in progress and the results so far (JSON-able)."""
        with self._lock:
            return {"sums": {str(v): dict(s) for v, s in self._sums.items()},
                    "weights": {str(v): dict(w) for v, w in self._weights.items()},
                    "reported": {str(v): sorted(r) for v, r in self._reported.items()},
                    "results": {str(v): dict(r) for v, r in self.results.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._sums = {int(v): dict(s) for v, s in state["sums"].items()}
            self._weights = {int(v): dict(w) for v, w in state["weights"].items()}
            self._reported = {int(v): set(r) for v, r in state["reported"].items()}
            self.results = {int(v): dict(r) for v, r in state["results"].items()}
