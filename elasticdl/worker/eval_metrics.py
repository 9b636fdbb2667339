"""The worker's side of evaluation metrics: plain functions and stateful metrics
(:mod:`elasticdl.api.metrics`, torchmetrics) updated per minibatch, their states
serialised per task (``torch.save`` of tensors, loaded back with
``weights_only=True``) and merged by the version's finalize task."""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from elasticdl.api.metrics import Metric, is_stateful, is_torchmetric

logger = logging.getLogger(__name__)

MetricValue = tuple[str, float, int]  # name, value, weight (samples)


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return [_cpu(v) for v in value]
    return value


def _state_of(metric: Any) -> dict[str, Any]:
    if is_torchmetric(metric):
        return {name: _cpu(getattr(metric, name)) for name in metric._defaults}
    return {k: _cpu(v) for k, v in metric.state().items()}


def _to(value: Any, device: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    return value


def _merge_torchmetric(metric: Any, states: Sequence[dict[str, Any]]) -> None:
    """Combine the states with each state's ``dist_reduce_fx`` (as torchmetrics
    does across processes): the first state is taken as it is, the others reduced
    into it."""
    metric.reset()
    device = metric.device
    for i, state in enumerate(states):
        unknown = set(state) - set(metric._defaults)
        if unknown:
            raise ValueError(f"metric states {sorted(unknown)} are not states of "
                             f"{type(metric).__name__}")
        state = {k: _to(v, device) for k, v in state.items()}
        if i == 0:
            for name, value in state.items():
                setattr(metric, name, value)
        else:
            metric._reduce_states(state)
    metric._update_count = max(len(states), 1)
    metric._computed = None


def _value(result: Any, name: str) -> float:
    if isinstance(result, torch.Tensor):
        if result.numel() != 1:
            raise ValueError(f"metric {name!r} computed {tuple(result.shape)} values; a "
                             "job metric must be one number")
        result = result.item()
    return float(result)


class EvalMetrics:
    """The module's ``eval_metrics_fn()`` metrics for one worker.

    Plain functions give per-task record-weighted means; stateful metrics are
    reset at each task, updated per minibatch and serialised at its end.
    """

    def __init__(self, metrics: Mapping[str, Any], device: Any = "cpu"):
        self.plain = {n: m for n, m in metrics.items() if not is_stateful(m)}
        self.stateful = {n: m for n, m in metrics.items() if is_stateful(m)}
        for m in self.stateful.values():
            if is_torchmetric(m):
                m.to(device)
        self._sums: dict[str, float] = {}
        self._count = 0

    def begin_task(self) -> None:
        self._sums, self._count = {}, 0
        for m in self.stateful.values():
            m.reset()

    def update(self, labels: Any, outputs: Any, n: int) -> None:
        for name, fn in self.plain.items():
            self._sums[name] = self._sums.get(name, 0.0) + float(fn(labels, outputs)) * n
        for m in self.stateful.values():
            if is_torchmetric(m):
                m.update(outputs, labels)   # torchmetrics: update(preds, target)
            else:
                m.update(labels, outputs)
        self._count += n

    def end_task(self) -> tuple[list[MetricValue], bytes]:
        """The task's plain metrics ``(name, mean, records)`` and its stateful
        metrics' states as one blob (``b""`` when there are none)."""
        count = self._count
        plain = [(n, s / count, count) for n, s in self._sums.items()] if count else []
        if not self.stateful or not count:
            return plain, b""
        return plain, dump_states({n: _state_of(m) for n, m in self.stateful.items()})

    def finalize(self, blobs: Sequence[bytes]) -> list[MetricValue]:
        """Merge every task's states and compute the global values."""
        per_task = [load_states(b) for b in blobs]
        values: list[MetricValue] = []
        for name, metric in self.stateful.items():
            states = [s[name] for s in per_task if name in s]
            if not states:
                logger.warning("metric %s: no task reported a state", name)
                continue
            if is_torchmetric(metric):
                _merge_torchmetric(metric, states)
            else:
                assert isinstance(metric, Metric)
                metric.reset()
                metric.merge(states)
            values.append((name, _value(metric.compute(), name), len(states)))
        return values


def dump_states(states: Mapping[str, Mapping[str, Any]]) -> bytes:
    buf = io.BytesIO()
    torch.save({n: dict(s) for n, s in states.items()}, buf)
    return buf.getvalue()


def load_states(blob: bytes) -> dict[str, dict[str, Any]]:
    """Raises ValueError for a blob that is not a saved dict of metric states."""
    try:
        states = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with what it was
        raise ValueError(f"unreadable metric states ({len(blob)} bytes): "
                         f"{type(e).__name__}: {e}") from e
    if not isinstance(states, dict):
        raise ValueError(f"metric states must be a dict, got {type(states).__name__}")
    return states
