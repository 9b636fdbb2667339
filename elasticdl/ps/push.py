"""One push and one sync group of a PS: validation, record-weighted sums.

See :mod:`elasticdl.ps.shard` for how they are used.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from elasticdl.common.tensor_codec import dtype_name
from elasticdl.ps.parameters import Parameters

MAX_SYNC_GROUP = 1 << 16   # pushes a --divergence_sync group may ask for


@dataclass
class GradientPush:
    """One worker's gradients for this shard (already decoded). Dense gradients
    may be read-only views of received bytes: the shard never writes into them.

    ``minibatch`` is 1-based; 0 means the push carries no identity.
    ``grad_scale`` multiplies the gradients before aggregation (the worker's
    global-norm clip coefficient / fp16 loss scale); a ``discard`` push (an
    overflowed fp16 step) counts, with its identity, but applies nothing."""

    version: int
    worker_id: int = 0
    learning_rate: float = 0.0
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    sparse: list[tuple[str, np.ndarray, torch.Tensor]] = field(default_factory=list)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    task_id: int = 0
    minibatch: int = 0
    num_records: int = 0
    epoch: int = 0
    grad_scale: float = 1.0
    discard: bool = False
    lr_reductions: int = 0      # metric-driven LR reductions its task carried
    lr_scale: float = 1.0       # its task's divergence-rollback LR scale (master's)
    sync_group: int = 0         # its task's --divergence_sync group (0: the PS's mode)

    @property
    def identity(self) -> Optional[tuple[int, int]]:
        return (self.task_id, self.minibatch) if self.minibatch > 0 else None


@dataclass(frozen=True)
class PushResult:
    accepted: bool
    version: int
    duplicate: bool = False
    learning_rate: float = 0.0   # first param group's lr the push's group was applied with


@dataclass
class Group:
    """Gradients summed for the next sync version, in units of the first push's
    weight: ``dense = g0 + (n1/n0) g1 + ...`` (no copy for a group of one)."""

    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    sparse: dict[str, list[tuple[np.ndarray, torch.Tensor, float]]] = \
        field(default_factory=dict)
    count: int = 0
    weight0: float = 0.0
    total: float = 0.0
    workers: set[int] = field(default_factory=set)
    identities: dict[tuple[int, int], int] = field(default_factory=dict)
    started: float = 0.0
    done: bool = False
    dropped: bool = False  # discarded by a rollback: its pushes were not applied
    owned: set[str] = field(default_factory=set)  # dense sums that are our own tensors
    epoch: int = 0              # the newest epoch of its pushes
    lr_reductions: int = 0      # the most LR reductions any of its pushes carried
    lr_scale: float = 1.0       # the smallest divergence-rollback scale of its pushes
    learning_rate: float = 0.0  # set when applied

    def add(self, push: GradientPush) -> None:
        """Add a push, weighted by its records relative to the group's first
        (times its ``grad_scale``); a discarded push adds only its identity."""
        g = self
        if g.count == 0:
            g.started = time.monotonic()
        g.count += 1
        g.workers.add(push.worker_id)
        g.epoch = max(g.epoch, push.epoch)
        g.lr_reductions = max(g.lr_reductions, push.lr_reductions)
        g.lr_scale = min(g.lr_scale, push.lr_scale)
        if push.identity is not None:
            g.identities[push.identity] = push.num_records
        if push.discard:
            return
        weight = float(push.num_records or 1)
        if g.total == 0:
            g.weight0 = weight
        rel = weight / g.weight0 * push.grad_scale
        for name, grad in push.dense.items():
            acc = g.dense.get(name)
            if acc is None:
                # may be a read-only view of the received bytes: never written into
                g.dense[name] = grad if rel == 1.0 else grad * rel
                if rel != 1.0:
                    g.owned.add(name)
            elif name not in g.owned:
                g.dense[name] = torch.add(acc, grad, alpha=rel)  # ours from now on
                g.owned.add(name)
            else:
                acc.add_(grad, alpha=rel)
        for table, ids, grad in push.sparse:
            g.sparse.setdefault(table, []).append((ids, grad, rel))
        g.total += weight


def validate(params: Parameters, push: GradientPush) -> None:
    """Check a push against a shard's parameters: names, shapes, dtypes, finite
    values, no learning rate.

    Raises:
        ValueError: the first problem found.
    """
    p = params
    if push.learning_rate:
        raise ValueError(f"push sets learning_rate={push.learning_rate}: the learning "
                         "rate is the optimizer's (the model's optimizer()); a client "
                         "may not change it")
    if push.lr_reductions < 0:
        raise ValueError(f"lr_reductions must be >= 0, got {push.lr_reductions}")
    if not (math.isfinite(push.lr_scale) and 0 < push.lr_scale <= 1):
        raise ValueError(f"lr_scale must be in (0, 1], got {push.lr_scale}")
    if not 0 <= push.sync_group <= MAX_SYNC_GROUP:
        raise ValueError(f"sync_group must be in [0, {MAX_SYNC_GROUP}], got {push.sync_group}")
    if push.minibatch < 0 or push.num_records < 0 or push.epoch < 0:
        raise ValueError(f"minibatch ({push.minibatch}), num_records "
                         f"({push.num_records}) and epoch ({push.epoch}) must be >= 0")
    if not (math.isfinite(push.grad_scale) and push.grad_scale > 0):
        raise ValueError(f"grad_scale must be a finite number > 0, got {push.grad_scale}")
    for name, grad in push.dense.items():
        param = p.dense.get(name)
        if param is None:
            raise ValueError(f"gradient for unknown parameter {name!r} on PS {p.ps_id}")
        if not param.requires_grad:
            raise ValueError(f"parameter {name!r} is not trainable ({param.dtype})")
        _check_like(f"gradient of {name!r}", grad, param)
        _check_finite(f"gradient of parameter {name!r}", grad, push)
    for name, value in push.buffers.items():
        buf = p.buffers.get(name)
        if buf is None:
            raise ValueError(f"unknown buffer {name!r} on PS {p.ps_id}")
        _check_like(f"buffer {name!r}", value, buf)
    for table_name, ids, grad in push.sparse:
        table = p.table(table_name)
        what = f"gradient of table {table_name!r}"
        if ids.ndim != 1:
            raise ValueError(f"{what}: ids must be 1-D")
        expected = (ids.shape[0], table.spec.dim)
        if tuple(grad.shape) != expected or grad.dtype != table.spec.dtype:
            raise ValueError(f"{what}: values {dtype_name(grad.dtype)}{list(grad.shape)}, "
                             f"expected {dtype_name(table.spec.dtype)}{list(expected)}")
        table.check_ids(ids, what)
        _check_finite(what, grad, push)


def _check_like(what: str, value: torch.Tensor, ref: torch.Tensor) -> None:
    if value.dtype != ref.dtype:
        raise ValueError(f"{what}: dtype {dtype_name(value.dtype)} does not match "
                         f"{dtype_name(ref.dtype)}")
    if value.shape != ref.shape:
        raise ValueError(f"{what}: shape {list(value.shape)} does not match {list(ref.shape)}")


def _check_finite(what: str, value: torch.Tensor, push: GradientPush) -> None:
    """Raise ValueError for NaN/Inf values. A sum (no temporary tensor) finds them;
    only a non-finite sum - NaN/Inf inside, or an overflow of huge finite values -
    is checked element-wise."""
    if not value.dtype.is_floating_point or math.isfinite(float(value.sum())):
        return
    if not bool(torch.isfinite(value).all()):
        kind = "NaN" if bool(torch.isnan(value).any()) else "Inf"
        where = f" (task {push.task_id}, minibatch {push.minibatch})" if push.minibatch else ""
        raise ValueError(f"{what} contains {kind} values{where}, from worker "
                         f"{push.worker_id}; gradients must be finite")


def coalesce(parts: list[tuple[np.ndarray, torch.Tensor, float]]
              ) -> tuple[np.ndarray, torch.Tensor]:
    """Sum the (weighted) gradients of repeated ids; returns unique ids and their rows."""
    if len(parts) == 1:
        ids, grad, w = parts[0]
        uniq, inverse = np.unique(ids, return_inverse=True)
        if w != 1.0:
            grad = grad * w
            w = 1.0
        if uniq.shape[0] == ids.shape[0]:
            order = np.argsort(ids, kind="stable")
            out = grad.index_select(0, torch.from_numpy(order))
            return ids[order], out
    else:
        ids = np.concatenate([p[0] for p in parts])
        grad = torch.cat([p[1] * p[2] if p[2] != 1.0 else p[1] for p in parts])
        uniq, inverse = np.unique(ids, return_inverse=True)
    out = torch.zeros((uniq.shape[0], grad.shape[1]), dtype=grad.dtype)
    out.index_add_(0, torch.from_numpy(inverse.reshape(-1)), grad)
    return uniq, out
