"""Aggregating evaluation metrics reported per task into one result per model version.

Two kinds of metrics (see ``elasticdl.api.metrics`` and docs/training.md):

* plain ``fn(labels, outputs) -> number``: each worker reports, per evaluation
  task, the value over the task's records and the number of records; the
  result is the sample-weighted mean over all the version's tasks.
* stateful metrics (``elasticdl.api.metrics.Metric``, torchmetrics ``Metric``):
  each worker reports, per task, the metrics' states serialised into one
  opaque blob. The master keeps the blobs of a version (it never looks inside:
  no torch here) until every evaluation task of the version is done; then one
  more task, ``EVALUATION_FINALIZE``, carries all of them to a worker, which
  merges and computes them and reports the exact global values.

Each task counts once (a retried or reassigned task's second report is
ignored), so the result is exact whatever the order or the failures. The
blobs are part of :meth:`state_dict` (base64), so a restarted master goes on.
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, Optional

logger = logging.getLogger(__name__)

# bounds on what the master keeps (and journals) per model version: the blob of
# one task, and all the blobs of a version (they travel in one finalize task)
MAX_TASK_STATE_BYTES = 64 << 20
MAX_VERSION_STATE_BYTES = 256 << 20


class MetricStateError(ValueError):
    """Metric states beyond the documented bounds (or otherwise unusable)."""


class EvaluationAggregator:
    def __init__(self, on_result: Optional[Callable[[int, dict[str, float]], None]] = None):
        self._lock = threading.Lock()
        self._sums: dict[int, dict[str, float]] = {}
        self._weights: dict[int, dict[str, int]] = {}
        self._reported: dict[int, set[int]] = {}
        self._states: dict[int, dict[int, bytes]] = {}     # version -> task -> blob
        self._finals: dict[int, dict[str, float]] = {}     # version -> merged values
        self._finalizing: set[int] = set()                 # finalize task created
        self.results: dict[int, dict[str, float]] = {}
        self._on_result = on_result

    def add(self, model_version: int, task_id: int,
            metrics: Iterable[tuple[str, float, int]], states: bytes = b"") -> None:
        """Add one task's ``(name, value, weight)`` metrics and its serialised metric
        states; a task counts once.

        Raises:
            MetricStateError: the blob or the version's blobs exceed the bounds
                (nothing is recorded).
        """
        with self._lock:
            if model_version in self.results:
                logger.info("metrics of task %d for version %d, already complete: ignored",
                            task_id, model_version)
                return
            seen = self._reported.setdefault(model_version, set())
            if task_id in seen:
                return
            if states:
                kept = sum(map(len, self._states.get(model_version, {}).values()))
                if len(states) > MAX_TASK_STATE_BYTES or \
                        kept + len(states) > MAX_VERSION_STATE_BYTES:
                    raise MetricStateError(
                        f"metric states of task {task_id} ({len(states)} bytes; "
                        f"{kept} kept for version {model_version}) exceed the bounds "
                        f"({MAX_TASK_STATE_BYTES} per task, {MAX_VERSION_STATE_BYTES} per "
                        "version): use smaller metric states (e.g. AUC(num_thresholds=...))")
                self._states.setdefault(model_version, {})[task_id] = bytes(states)
            seen.add(task_id)
            sums = self._sums.setdefault(model_version, {})
            weights = self._weights.setdefault(model_version, {})
            for name, value, weight in metrics:
                if weight <= 0:
                    continue
                sums[name] = sums.get(name, 0.0) + float(value) * weight
                weights[name] = weights.get(name, 0) + int(weight)

    def add_final(self, model_version: int, metrics: Iterable[tuple[str, float, int]]
                  ) -> None:
        """The merged values of the version's stateful metrics (its finalize task);
        the first report counts."""
        with self._lock:
            if model_version in self._finals or model_version in self.results:
                return
            self._finals[model_version] = {name: float(v) for name, v, _ in metrics}

    def needs_finalize(self, model_version: int) -> bool:
        """True (once per version) when the version's tasks left metric states that a
        finalize task must merge; the caller then creates that task."""
        with self._lock:
            if not self._states.get(model_version) or model_version in self._finalizing:
                return False
            self._finalizing.add(model_version)
            return True

    def states_for(self, model_version: int) -> tuple[bytes, ...]:
        """The version's metric state blobs, in task order (for its finalize task)."""
        with self._lock:
            kept = self._states.get(model_version, {})
            return tuple(kept[t] for t in sorted(kept))

    def discard(self, model_version: int) -> None:
        """Forget a version's evaluation in progress (a PS rollback dropped it)."""
        with self._lock:
            for d in (self._sums, self._weights, self._reported, self._states, self._finals):
                d.pop(model_version, None)
            self._finalizing.discard(model_version)

    def complete(self, model_version: int) -> dict[str, float]:
        """Close a model version's evaluation (all its tasks are done)."""
        with self._lock:
            sums = self._sums.pop(model_version, {})
            weights = self._weights.pop(model_version, {})
            self._reported.pop(model_version, None)
            had_states = bool(self._states.pop(model_version, None))
            finals = self._finals.pop(model_version, {})
            self._finalizing.discard(model_version)
            result = {name: sums[name] / weights[name] for name in sums}
            result.update(finals)
            result = dict(sorted(result.items()))
            self.results[model_version] = result
        if had_states and not finals:
            logger.warning("evaluation of model version %d: stateful metrics were never "
                           "merged (no finalize result)", model_version)
        logger.info("evaluation of model version %d: %s", model_version,
                    ", ".join(f"{k}={v:.4f}" for k, v in result.items()))
        if self._on_result is not None:
            self._on_result(model_version, result)
        return result

    def state_dict(self) -> dict[str, Any]:
        """Partial sums and metric states of evaluations in progress and the results
        so far (JSON-able; state blobs as base64)."""
        with self._lock:
            return {"sums": {str(v): dict(s) for v, s in self._sums.items()},
                    "weights": {str(v): dict(w) for v, w in self._weights.items()},
                    "reported": {str(v): sorted(r) for v, r in self._reported.items()},
                    "states": {str(v): {str(t): base64.b64encode(b).decode("ascii")
                                        for t, b in s.items()}
                               for v, s in self._states.items()},
                    "finals": {str(v): dict(f) for v, f in self._finals.items()},
                    "finalizing": sorted(self._finalizing),
                    "results": {str(v): dict(r) for v, r in self.results.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._sums = {int(v): dict(s) for v, s in state["sums"].items()}
            self._weights = {int(v): dict(w) for v, w in state["weights"].items()}
            self._reported = {int(v): set(r) for v, r in state["reported"].items()}
            self._states = {int(v): {int(t): base64.b64decode(b) for t, b in s.items()}
                            for v, s in state.get("states", {}).items()}
            self._finals = {int(v): dict(f) for v, f in state.get("finals", {}).items()}
            self._finalizing = {int(v) for v in state.get("finalizing", [])}
            self.results = {int(v): dict(r) for v, r in state["results"].items()}
