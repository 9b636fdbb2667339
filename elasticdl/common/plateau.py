"""A metric-driven learning-rate schedule without torch: ReduceLROnPlateau's rule.

The master steps this mirror at every evaluation with the monitored metric
(it never imports torch); it decides *when* the rate is reduced. Whoever holds
an optimizer (each PS shard, each allreduce member) applies the reductions to
its own param groups with :func:`reduce_lrs`, the same arithmetic as torch's
``ReduceLROnPlateau._reduce_lr`` (factor, per-group ``min_lr``, ``eps``). The
number of reductions decided so far travels with every training task and push,
so a holder that missed some (a relaunched PS, a new allreduce member) catches
up exactly, and applying a count twice changes nothing.

:class:`PlateauState` reproduces ``torch.optim.lr_scheduler.ReduceLROnPlateau
.step(metric)`` decision for decision: ``mode`` (min/max), ``threshold`` with
``threshold_mode`` (rel/abs), ``patience``, ``cooldown``; a NaN metric is never
better (a bad evaluation), as in torch. tests/unit/common/test_plateau.py
checks it against torch's scheduler on random metric sequences.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class PlateauRule:
    """The schedule's parameters (read from the module's ReduceLROnPlateau by the
    process that loads the model) and the metric it monitors."""

    monitor: str
    mode: str = "min"
    factor: float = 0.1
    patience: int = 10
    threshold: float = 1e-4
    threshold_mode: str = "rel"
    cooldown: int = 0
    min_lrs: tuple[float, ...] = (0.0,)
    eps: float = 1e-8
    initial_lrs: tuple[float, ...] = field(default=())   # the optimizer's groups at start

    def __post_init__(self) -> None:
        if not self.monitor:
            raise ValueError("a metric-driven schedule needs the metric it monitors")
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}")
        if self.threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold_mode must be 'rel' or 'abs', got "
                             f"{self.threshold_mode!r}")
        if not self.factor < 1.0:
            raise ValueError(f"factor must be < 1.0, got {self.factor}")
        if self.patience < 0 or self.cooldown < 0:
            raise ValueError("patience and cooldown must be >= 0")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PlateauRule:
        d = json.loads(text)
        d["min_lrs"] = tuple(float(v) for v in d.get("min_lrs", (0.0,)))
        d["initial_lrs"] = tuple(float(v) for v in d.get("initial_lrs", ()))
        return cls(**d)

    @classmethod
    def of_scheduler(cls, scheduler: Any, monitor: str,
                     lrs: Sequence[float] = ()) -> PlateauRule:
        """The rule of a ``torch.optim.lr_scheduler.ReduceLROnPlateau`` (duck-typed:
        this module imports no torch)."""
        return cls(monitor=monitor, mode=scheduler.mode, factor=float(scheduler.factor),
                   patience=int(scheduler.patience), threshold=float(scheduler.threshold),
                   threshold_mode=scheduler.threshold_mode, cooldown=int(scheduler.cooldown),
                   min_lrs=tuple(float(v) for v in scheduler.min_lrs),
                   eps=float(scheduler.eps), initial_lrs=tuple(float(v) for v in lrs))


def reduce_lrs(lrs: Sequence[float], factor: float, min_lrs: Sequence[float],
               eps: float) -> list[float]:
    """One reduction of every group's rate: ``max(lr * factor, min_lr)``, kept only
    when it lowers the rate by more than ``eps`` (torch's ``_reduce_lr``)."""
    if len(min_lrs) == 1 and len(lrs) != 1:
        min_lrs = list(min_lrs) * len(lrs)
    if len(min_lrs) != len(lrs):
        raise ValueError(f"{len(lrs)} param groups but {len(min_lrs)} min_lrs")
    out = []
    for old, floor in zip(lrs, min_lrs):
        new = max(float(old) * factor, float(floor))
        out.append(new if float(old) - new > eps else float(old))
    return out


class PlateauState:
    """ReduceLROnPlateau's decision state, stepped with one metric per evaluation."""

    def __init__(self, rule: PlateauRule):
        self.rule = rule
        self.best = math.inf if rule.mode == "min" else -math.inf
        self.num_bad_epochs = 0
        self.cooldown_counter = 0
        self.last_epoch = 0          # evaluations stepped
        self.reductions = 0          # reductions decided
        self.last_reduced_version: Optional[int] = None
        self.lrs: list[float] = list(rule.initial_lrs)

    def is_better(self, a: float, best: float) -> bool:
        r = self.rule
        if r.mode == "min" and r.threshold_mode == "rel":
            return a < best * (1.0 - r.threshold)
        if r.mode == "min":
            return a < best - r.threshold
        if r.threshold_mode == "rel":
            return a > best * (r.threshold + 1.0)
        return a > best + r.threshold

    def step(self, metric: float, version: Optional[int] = None) -> bool:
        """One evaluation's value of the monitored metric; whether the rate is
        reduced now."""
        current = float(metric)
        self.last_epoch += 1
        if self.is_better(current, self.best):
            self.best = current
            self.num_bad_epochs = 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.rule.patience:
            self.reductions += 1
            self.last_reduced_version = version
            if self.lrs:
                self.lrs = reduce_lrs(self.lrs, self.rule.factor, self.rule.min_lrs,
                                      self.rule.eps)
            self.cooldown_counter = self.rule.cooldown
            self.num_bad_epochs = 0
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        """JSON-able (an infinite ``best`` as a string)."""
        return {"best": self.best if math.isfinite(self.best) else repr(self.best),
                "num_bad_epochs": self.num_bad_epochs,
                "cooldown_counter": self.cooldown_counter, "last_epoch": self.last_epoch,
                "reductions": self.reductions,
                "last_reduced_version": self.last_reduced_version, "lrs": list(self.lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = float(state["best"])
        self.num_bad_epochs = int(state["num_bad_epochs"])
        self.cooldown_counter = int(state["cooldown_counter"])
        self.last_epoch = int(state["last_epoch"])
        self.reductions = int(state["reductions"])
        v = state.get("last_reduced_version")
        self.last_reduced_version = None if v is None else int(v)
        self.lrs = [float(x) for x in state.get("lrs", self.lrs)]
