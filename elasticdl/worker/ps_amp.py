"""Global gradient norm and fp16 loss scaling for a worker whose optimizer is on the PS.

The worker has the whole gradient of a step (dense parameters and the pulled
embedding rows) but streams its parts to the parameter servers while backward
runs. :class:`GradNorm` keeps that overlap: it takes each part's norm as the
autograd hooks produce it and, once backward is done, gives the factor every
PS multiplies its part of the push by (``grad_scale``):

* global-norm clipping: ``min(1, max_norm / (total_norm + 1e-6))`` with
  ``total_norm`` the L2 norm of the per-tensor norms - exactly
  ``torch.nn.utils.clip_grad_norm_``. An embedding table counts as the dense
  gradient a local ``nn.Embedding`` would have: rows not in the batch are
  zero and repeated ids were summed (the pulled row block of unique ids);
* fp16 AMP: the loss was multiplied by :class:`LossScaler`'s scale before
  backward, so the gradients are unscaled by ``1 / scale`` (clipping sees the
  unscaled norm). A non-finite norm means an overflow: the step is skipped
  (every PS still gets its push, marked ``discard``) and the scale backs off,
  as ``torch.amp.GradScaler`` does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass
class LossScaler:
    """``torch.amp.GradScaler``'s dynamic loss scale, without an optimizer
    (the optimizer is on the PS): :meth:`update` is ``torch._amp_update_scale_``."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0

    def inv_scale(self) -> float:
        """``1 / scale`` rounded to float32, as GradScaler.unscale_ computes it."""
        return float(torch.tensor(self.scale, dtype=torch.float64).reciprocal().float())

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = float(np.float32(self.scale * self.growth_factor))
            if np.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0


class GradNorm:
    """Per-tensor gradient norms of one step, collected from autograd hooks.

    ``float64``: accumulate in double precision, so that the norm is infinite
    exactly when an element is (what GradScaler checks); in float32 the squares
    of large finite gradients would overflow. Otherwise float32, as
    ``clip_grad_norm_`` computes it."""

    def __init__(self, float64: bool = False) -> None:
        self._dtype = torch.float64 if float64 else None
        self._norms: list[torch.Tensor] = []
        self._rows: dict[str, list[tuple[np.ndarray, torch.Tensor]]] = {}
        self._lock = threading.Lock()

    def add_dense(self, grad: torch.Tensor) -> None:
        norm = torch.linalg.vector_norm(grad.detach(), 2, dtype=self._dtype)  # async on CUDA
        with self._lock:
            self._norms.append(norm)

    def add_rows(self, table: str, ids: np.ndarray, grad: torch.Tensor) -> None:
        """A pulled row block's gradient (unique ``ids``) of ``table``."""
        with self._lock:
            self._rows.setdefault(table, []).append((ids, grad.detach()))

    def total(self) -> float:
        """The L2 norm of all the step's gradients (one host sync)."""
        norms = list(self._norms)
        for blocks in self._rows.values():
            if len(blocks) == 1:
                norms.append(torch.linalg.vector_norm(blocks[0][1], 2, dtype=self._dtype))
                continue
            # one table looked up several times: its rows' gradients add up first
            ids = np.concatenate([b[0] for b in blocks])
            uniq, inverse = np.unique(ids, return_inverse=True)
            first = blocks[0][1]
            summed = torch.zeros((uniq.shape[0], first.shape[1]), dtype=first.dtype,
                                 device=first.device)
            summed.index_add_(0, torch.from_numpy(inverse.reshape(-1)).to(first.device),
                              torch.cat([b[1] for b in blocks]))
            norms.append(torch.linalg.vector_norm(summed, 2, dtype=self._dtype))
        if not norms:
            return 0.0
        device = norms[0].device
        return float(torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """``clip_grad_norm_``'s factor, computed in float32 as torch does."""
    norm = torch.tensor(total_norm, dtype=torch.float32)
    return float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))


def push_scale(norm: Optional[GradNorm], max_norm: float,
               scaler: Optional[LossScaler]) -> tuple[float, bool]:
    """``(grad_scale, discard)`` of a step whose backward is done.

    Raises:
        FloatingPointError: a non-finite gradient norm without loss scaling.
    """
    if norm is None:
        return 1.0, False
    inv = scaler.inv_scale() if scaler is not None else 1.0
    total = norm.total()
    finite = bool(np.isfinite(total))
    if scaler is not None:
        scaler.update(found_inf=not finite)
        if not finite:
            return 1.0, True
    elif not finite:
        raise FloatingPointError(f"non-finite gradient norm ({total})")
    if max_norm <= 0:
        return inv, False
    unscaled = float(np.float32(total) * np.float32(inv))
    coef = clip_coefficient(unscaled, max_norm)
    return float(np.float32(coef) * np.float32(inv)), False
