"""Row-wise optimizers for embedding tables, with per-row state.

A dense ``torch.optim`` optimizer would touch every row of a table at every
step; on a PS only the rows a gradient names are updated ("lazy" updates, as
TensorFlow's sparse optimizers do). For rows updated at every step the result
equals the dense torch optimizer's on those rows (tested to 1e-6).

:func:`row_optimizer_for` maps the optimizer the model module's
``optimizer(params)`` returns to its row-wise counterpart, reading the
hyperparameters from its first ``param_group``; :func:`refresh_row_optimizer`
reads them again before every apply, so learning-rate schedules reach the rows.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from typing import Optional

import torch

from elasticdl.ps.parameters import EmbeddingTable

logger = logging.getLogger(__name__)


class RowOptimizer(ABC):
    """Applies gradients to some rows of an :class:`EmbeddingTable`."""

    def __init__(self, lr: float, weight_decay: float = 0.0, maximize: bool = False):
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.maximize = bool(maximize)

    def uses_step(self) -> bool:
        """Whether the update reads a row's update count (bias correction, a decaying
        learning rate, the first momentum step). Where it does not, the table keeps no
        per-row ``step`` (8 bytes a row: 6% of a 16-wide Adagrad row)."""
        return True

    def prepare(self, table: EmbeddingTable) -> None:
        """Create the per-row statistics this optimizer keeps (idempotent). A ``step``
        kept from before (a checkpoint, another optimizer setting) goes on counting."""
        if self.uses_step() or "step" in table.state:
            table.ensure_state("step", 0.0, per_row_scalar=True)

    def apply(self, table: EmbeddingTable, slots: torch.Tensor, grad: torch.Tensor,
              lr: Optional[float] = None) -> None:
        """Update rows ``slots`` (unique) with ``grad`` (len(slots) x dim)."""
        self.prepare(table)
        if slots.numel() == 0:
            return
        lr = self.lr if lr is None else float(lr)
        grad = grad.to(table.weights.dtype)
        if self.maximize:
            grad = -grad
        params = table.weights.index_select(0, slots)
        step = None
        if "step" in table.state:
            step = table.state["step"].index_select(0, slots) + 1
            table.state["step"].index_copy_(0, slots, step)
        if self.weight_decay and not self._decoupled_decay():
            grad = grad + self.weight_decay * params
        params = self._update(table, slots, params, grad, step, lr)
        pad = table.spec.padding_idx
        if pad >= 0 and pad % table.num_ps == table.ps_id:
            keep = torch.from_numpy(table.row_ids[slots.numpy()] != pad)
            params = torch.where(keep[:, None], params, table.weights.index_select(0, slots))
        table.weights.index_copy_(0, slots, params)

    def _decoupled_decay(self) -> bool:
        return False

    @abstractmethod
    def _update(self, table: EmbeddingTable, slots: torch.Tensor, params: torch.Tensor,
                grad: torch.Tensor, step: Optional[torch.Tensor], lr: float) -> torch.Tensor:
        """New values of the rows; updates the optimizer state of the rows (``step``: the
        rows' update counts, this one included; None unless :meth:`uses_step`)."""

    def _state(self, table: EmbeddingTable, name: str, slots: torch.Tensor) -> torch.Tensor:
        return table.state[name].index_select(0, slots)

    def _put(self, table: EmbeddingTable, name: str, slots: torch.Tensor,
             value: torch.Tensor) -> None:
        table.state[name].index_copy_(0, slots, value)


class RowSGD(RowOptimizer):
    """torch.optim.SGD semantics (momentum, dampening, Nesterov) per row."""

    def __init__(self, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False):
        super().__init__(lr, weight_decay, maximize)
        self.momentum = float(momentum)
        self.dampening = float(dampening)
        self.nesterov = bool(nesterov)

    def uses_step(self) -> bool:
        return self.momentum != 0.0   # a row's first momentum step takes the gradient

    def prepare(self, table: EmbeddingTable) -> None:
        super().prepare(table)
        if self.momentum:
            table.ensure_state("momentum_buffer")

    def _update(self, table, slots, params, grad, step, lr):
        if self.momentum:
            assert step is not None
            buf = self._state(table, "momentum_buffer", slots)
            first = (step == 1)[:, None]
            buf = torch.where(first, grad, self.momentum * buf + (1 - self.dampening) * grad)
            self._put(table, "momentum_buffer", slots, buf)
            grad = grad + self.momentum * buf if self.nesterov else buf
        return params - lr * grad


class RowAdagrad(RowOptimizer):
    """torch.optim.Adagrad semantics per row (``sum`` starts at initial_accumulator_value)."""

    def __init__(self, lr: float, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10,
                 maximize: bool = False):
        super().__init__(lr, weight_decay, maximize)
        self.lr_decay = float(lr_decay)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.eps = float(eps)

    def uses_step(self) -> bool:
        return self.lr_decay != 0.0

    def prepare(self, table: EmbeddingTable) -> None:
        super().prepare(table)
        table.ensure_state("sum", self.initial_accumulator_value)

    def _update(self, table, slots, params, grad, step, lr):
        if self.lr_decay != 0.0:
            assert step is not None
            clr = (lr / (1 + (step - 1) * self.lr_decay)).to(params.dtype)[:, None]
        else:
            clr = torch.tensor(lr, dtype=params.dtype)
        acc = self._state(table, "sum", slots).addcmul(grad, grad, value=1)
        self._put(table, "sum", slots, acc)
        return params - clr * grad / (acc.sqrt() + self.eps)


class RowAdam(RowOptimizer):
    """torch.optim.Adam / AdamW semantics per row, bias correction by the row's step count."""

    def __init__(self, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, maximize: bool = False,
                 decoupled: bool = False):
        super().__init__(lr, weight_decay, maximize)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps = float(eps)
        self.amsgrad = bool(amsgrad)
        self.decoupled = bool(decoupled)

    def _decoupled_decay(self) -> bool:
        return self.decoupled

    def prepare(self, table: EmbeddingTable) -> None:
        super().prepare(table)
        table.ensure_state("exp_avg")
        table.ensure_state("exp_avg_sq")
        if self.amsgrad:
            table.ensure_state("max_exp_avg_sq")

    def _update(self, table, slots, params, grad, step, lr):
        assert step is not None
        if self.decoupled and self.weight_decay:
            params = params * (1 - lr * self.weight_decay)
        m = self._state(table, "exp_avg", slots).lerp(grad, 1 - self.beta1)
        v = self._state(table, "exp_avg_sq", slots).mul(self.beta2).addcmul(
            grad, grad, value=1 - self.beta2)
        self._put(table, "exp_avg", slots, m)
        self._put(table, "exp_avg_sq", slots, v)
        if self.amsgrad:
            v = torch.maximum(self._state(table, "max_exp_avg_sq", slots), v)
            self._put(table, "max_exp_avg_sq", slots, v)
        bias1 = 1 - torch.pow(self.beta1, step)
        bias2_sqrt = torch.sqrt(1 - torch.pow(self.beta2, step))
        step_size = (lr / bias1).to(params.dtype)[:, None]
        denom = v.sqrt() / bias2_sqrt.to(params.dtype)[:, None] + self.eps
        return params - step_size * m / denom


def _hyper(group: dict, name: str, default: object) -> object:
    value = group.get(name, default)
    if isinstance(value, torch.Tensor):
        value = value.item()
    return value


def _row_kwargs(optimizer: torch.optim.Optimizer) -> tuple[type[RowOptimizer], dict]:
    """The row-wise class matching ``optimizer`` and its hyperparameters, read
    from the optimizer's first ``param_group`` as they are now."""
    g = optimizer.param_groups[0]
    lr = float(_hyper(g, "lr", 1e-3))  # type: ignore[arg-type]
    maximize = bool(_hyper(g, "maximize", False))
    wd = float(_hyper(g, "weight_decay", 0.0))  # type: ignore[arg-type]
    if isinstance(optimizer, torch.optim.SGD):
        return RowSGD, dict(lr=lr, momentum=float(_hyper(g, "momentum", 0.0)),  # type: ignore[arg-type]
                            dampening=float(_hyper(g, "dampening", 0.0)),  # type: ignore[arg-type]
                            weight_decay=wd, nesterov=bool(_hyper(g, "nesterov", False)),
                            maximize=maximize)
    if isinstance(optimizer, torch.optim.Adagrad):
        return RowAdagrad, dict(
            lr=lr, lr_decay=float(_hyper(g, "lr_decay", 0.0)),  # type: ignore[arg-type]
            weight_decay=wd,
            initial_accumulator_value=float(
                _hyper(g, "initial_accumulator_value", 0.0)),  # type: ignore[arg-type]
            eps=float(_hyper(g, "eps", 1e-10)),  # type: ignore[arg-type]
            maximize=maximize)
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        betas = tuple(float(b.item() if isinstance(b, torch.Tensor) else b)
                      for b in g.get("betas", (0.9, 0.999)))
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
            g.get("decoupled_weight_decay", False))
        return RowAdam, dict(lr=lr, betas=(betas[0], betas[1]),
                             eps=float(_hyper(g, "eps", 1e-8)),  # type: ignore[arg-type]
                             weight_decay=wd, amsgrad=bool(_hyper(g, "amsgrad", False)),
                             maximize=maximize, decoupled=decoupled)
    raise ValueError(f"embedding tables support SGD (with momentum), Adagrad, Adam and AdamW; "
                     f"the model's optimizer is {type(optimizer).__name__}")


def row_optimizer_for(optimizer: torch.optim.Optimizer) -> RowOptimizer:
    """The row-wise counterpart of a torch optimizer, with its hyperparameters.

    Raises:
        ValueError: optimizers other than SGD (with or without momentum),
            Adagrad, Adam and AdamW have no row-wise version.
    """
    cls, kwargs = _row_kwargs(optimizer)
    return cls(**kwargs)


def refresh_row_optimizer(row: RowOptimizer, optimizer: torch.optim.Optimizer) -> None:
    """Take ``optimizer``'s current hyperparameters (first param group) into ``row``:
    a learning-rate scheduler (or one that cycles momentum/betas) reaches the
    embedding rows at every apply. The per-row state is in the tables, not here."""
    cls, kwargs = _row_kwargs(optimizer)
    if cls is not type(row):
        raise ValueError(f"optimizer {type(optimizer).__name__} no longer matches the row "
                         f"optimizer {type(row).__name__}")
    row.__init__(**kwargs)  # type: ignore[misc]


def check_finite_lr(lr: float) -> float:
    """Raise ValueError for a learning rate that is not a finite number >= 0."""
    if not math.isfinite(lr) or lr < 0:
        raise ValueError(f"learning_rate must be a finite number >= 0, got {lr}")
    return lr
