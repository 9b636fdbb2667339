"""Stateful evaluation metrics, exact across workers and tasks.

``eval_metrics_fn()`` returns ``{name: metric}`` where a metric is either

* a plain function ``fn(labels, outputs) -> number``: the job reports the
  record-weighted mean of its per-minibatch values (exact for means of
  per-record quantities such as accuracy; *not* for AUC, precision, ...);
* a **stateful metric**: an object of the small protocol below (the classes of
  this module), or a ``torchmetrics.Metric`` (used through its
  ``update(preds, target)``/``compute()``/``reset()`` and its states'
  ``dist_reduce_fx``; torchmetrics is optional and only recognised if installed).

A stateful metric is updated with every minibatch of an evaluation task; the
task's state travels to the master as bytes; when every task of the model
version is done, one worker merges all the states and computes the value, as
if one process had seen the whole validation set.

The protocol (subclass :class:`Metric`)::

    update(labels, outputs)         # one minibatch
    state() -> dict[str, Tensor]    # this metric's state (tensors, lists of them)
    merge(states: list[dict])       # add other instances' states to this one
    compute() -> float
    reset()

Calling a metric, ``metric(labels, outputs)``, gives its value on that one
minibatch without touching its state. ``merge`` must be order-independent: the
result may not depend on how the records were split into tasks and workers.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import torch

__all__ = ["AUC", "Accuracy", "Mean", "Metric", "is_stateful"]


class Metric(ABC):
    """The protocol of a stateful, mergeable metric (see the module)."""

    @abstractmethod
    def update(self, labels: Any, outputs: Any) -> None:
        """Add one minibatch."""

    @abstractmethod
    def state(self) -> dict[str, Any]:
        """The state accumulated since :meth:`reset` (tensors or lists of tensors)."""

    @abstractmethod
    def merge(self, states: Sequence[dict[str, Any]]) -> None:
        """Add the states of other instances (from :meth:`state`) to this one."""

    @abstractmethod
    def compute(self) -> float:
        """The metric over everything updated and merged since :meth:`reset`."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every update and merge."""

    def __call__(self, labels: Any, outputs: Any) -> float:
        """The metric of this one minibatch alone (the accumulated state is untouched),
        so a metric also works where a plain ``fn(labels, outputs)`` is expected."""
        batch = copy.copy(self)
        batch.reset()
        batch.update(labels, outputs)
        return batch.compute()


def is_stateful(obj: Any) -> bool:
    """True for a :class:`Metric` or a ``torchmetrics.Metric`` (if installed)."""
    return isinstance(obj, Metric) or is_torchmetric(obj)


def is_torchmetric(obj: Any) -> bool:
    import sys

    if "torchmetrics" not in sys.modules:  # not imported by the user: cannot be one
        return False
    from torchmetrics import Metric as TorchMetric

    return isinstance(obj, TorchMetric)


def _as_numpy(x: Any, dtype: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64 if dtype == np.float64 else x.dtype).numpy()
    return np.asarray(x, dtype=dtype)


def _scores(outputs: Any) -> np.ndarray:
    """1-D scores: ``(N,)`` or ``(N, 1)`` as they are; ``(N, 2)`` (two-class logits,
    log-probabilities or probabilities) as ``col1 - col0``, monotone in the
    positive class's probability."""
    out = _as_numpy(outputs, np.float64)
    if out.ndim == 2 and out.shape[1] == 2:
        return out[:, 1] - out[:, 0]
    if out.ndim == 2 and out.shape[1] == 1:
        return out[:, 0]
    if out.ndim != 1:
        raise ValueError(f"AUC needs scores of shape (N,), (N, 1) or (N, 2), got {out.shape}")
    return out


class AUC(Metric):
    """Exact binary ROC AUC, equal to ``sklearn.metrics.roc_auc_score``, ties
    included (a tied positive/negative pair counts one half).

    The state is, per distinct score, the number of positive and negative
    records: merging adds counts, so the result does not depend on the order
    or the split of the records. Its size grows with the distinct scores seen
    (at most the validation records; 24 bytes each). ``num_thresholds`` > 0
    bounds it by rounding scores into that many equal bins of ``[0, 1]`` first
    (approximate; scores outside are clipped). ``outputs``: see :func:`_scores`;
    ``labels``: 0/1 (or bool) with ``pos_label`` the positive class.
    """

    def __init__(self, num_thresholds: int = 0, pos_label: int = 1):
        if num_thresholds < 0:
            raise ValueError(f"num_thresholds must be >= 0, got {num_thresholds}")
        self.num_thresholds = num_thresholds
        self.pos_label = pos_label
        self.reset()

    def reset(self) -> None:
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def update(self, labels: Any, outputs: Any) -> None:
        scores = _scores(outputs)
        labels_np = _as_numpy(labels, np.float64).reshape(-1)
        if labels_np.shape[0] != scores.shape[0]:
            raise ValueError(f"AUC: {labels_np.shape[0]} labels for {scores.shape[0]} scores")
        if self.num_thresholds:
            scores = np.round(np.clip(scores, 0.0, 1.0) * self.num_thresholds)
        pos = labels_np == self.pos_label
        self._add(scores, pos.astype(np.int64), (~pos).astype(np.int64))

    def _add(self, scores: np.ndarray, pos: np.ndarray, neg: np.ndarray) -> None:
        self._parts.append((scores, pos, neg))
        if len(self._parts) > 64:
            self._compact()

    def _compact(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self._parts:
            empty = np.zeros(0, np.int64)
            return np.zeros(0, np.float64), empty, empty
        scores = np.concatenate([p[0] for p in self._parts])
        unique, inverse = np.unique(scores, return_inverse=True)
        pos = np.bincount(inverse, np.concatenate([p[1] for p in self._parts]),
                          len(unique)).astype(np.int64)
        neg = np.bincount(inverse, np.concatenate([p[2] for p in self._parts]),
                          len(unique)).astype(np.int64)
        self._parts = [(unique, pos, neg)]
        return unique, pos, neg

    def state(self) -> dict[str, Any]:
        scores, pos, neg = self._compact()
        return {"scores": torch.from_numpy(scores.copy()), "pos": torch.from_numpy(pos.copy()),
                "neg": torch.from_numpy(neg.copy())}

    def merge(self, states: Sequence[dict[str, Any]]) -> None:
        # the states are in memory already: one compaction (one sort) for all of them
        self._parts.extend((_as_numpy(s["scores"], np.float64), _as_numpy(s["pos"], np.int64),
                            _as_numpy(s["neg"], np.int64)) for s in states)
        self._compact()

    def compute(self) -> float:
        _, pos, neg = self._compact()  # ascending scores
        total_pos, total_neg = int(pos.sum()), int(neg.sum())
        if total_pos == 0 or total_neg == 0:
            raise ValueError(f"AUC is undefined with {total_pos} positive and {total_neg} "
                             "negative records (sklearn raises too)")
        # each negative beats the positives below it, and ties half
        below = np.cumsum(pos) - pos
        wins2 = int(np.sum(neg * (2 * below + pos)))   # twice the count, exact integers
        return 1.0 - wins2 / (2.0 * total_pos * total_neg)


class Accuracy(Metric):
    """Fraction of records whose predicted class is the label: ``argmax`` of
    ``(N, C)`` outputs with C > 1, else ``output >= threshold`` for ``(N,)`` or
    ``(N, 1)`` probabilities (use ``threshold=0.0`` for logits)."""

    def __init__(self, threshold: float = 0.5):
        self.threshold = threshold
        self.reset()

    def reset(self) -> None:
        self._correct = 0
        self._total = 0

    def update(self, labels: Any, outputs: Any) -> None:
        out = outputs.detach() if isinstance(outputs, torch.Tensor) else torch.as_tensor(outputs)
        lab = labels.detach() if isinstance(labels, torch.Tensor) else torch.as_tensor(labels)
        if out.dim() == 2 and out.shape[1] > 1:
            pred = out.argmax(dim=1)
        else:
            pred = (out.reshape(-1) >= self.threshold).to(torch.int64)
        lab = lab.reshape(-1).to(pred.device)
        if lab.shape[0] != pred.shape[0]:
            raise ValueError(f"Accuracy: {lab.shape[0]} labels for {pred.shape[0]} outputs")
        self._correct += int((pred == lab.to(pred.dtype)).sum())
        self._total += int(lab.shape[0])

    def state(self) -> dict[str, Any]:
        return {"correct": torch.tensor(self._correct, dtype=torch.int64),
                "total": torch.tensor(self._total, dtype=torch.int64)}

    def merge(self, states: Sequence[dict[str, Any]]) -> None:
        for s in states:
            self._correct += int(s["correct"])
            self._total += int(s["total"])

    def compute(self) -> float:
        if not self._total:
            raise ValueError("Accuracy of no records")
        return self._correct / self._total


class Mean(Metric):
    """The mean over records of ``fn(labels, outputs)``: ``fn`` returns one value
    per record (exact mean), or one number for the minibatch (weighted by the
    minibatch's records, as a plain metric function is)."""

    def __init__(self, fn: Optional[Callable[[Any, Any], Any]] = None):
        self.fn = fn
        self.reset()

    def reset(self) -> None:
        self._sum = 0.0
        self._count = 0

    def update(self, labels: Any, outputs: Any) -> None:
        value = outputs if self.fn is None else self.fn(labels, outputs)
        v = _as_numpy(value, np.float64)
        if v.ndim == 0:
            n = len(labels) if hasattr(labels, "__len__") else 1
            self._sum += float(v) * n
            self._count += n
        else:
            self._sum += float(v.sum())
            self._count += int(v.size)

    def state(self) -> dict[str, Any]:
        return {"sum": torch.tensor(self._sum, dtype=torch.float64),
                "count": torch.tensor(self._count, dtype=torch.int64)}

    def merge(self, states: Sequence[dict[str, Any]]) -> None:
        for s in states:
            self._sum += float(s["sum"])
            self._count += int(s["count"])

    def compute(self) -> float:
        if not self._count:
            raise ValueError("Mean of no records")
        return self._sum / self._count
