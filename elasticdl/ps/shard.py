"""The state machine of one parameter server, without gRPC.

:class:`PSShard` validates pushes and pulls, aggregates gradients and applies
them with the model module's optimizer:

* **sync** (default): gradients computed on a version older than
  ``version - sync_version_tolerance`` are rejected; accepted pushes are summed
  until ``grads_to_wait`` of them arrived, then averaged and applied, and the
  version is bumped. A push waits until the group it joined is applied, so
  workers step in lockstep and sync training equals single-process training
  on the union of their batches. The wait adapts: 10x the usual spread
  between a group's first and last push, clamped to
  ``[sync_wait_min_s, sync_wait_s]`` (the cap until a first group completed).
  If it times out (a peer died, or ran out of data at the end of an epoch),
  pushes stop waiting until a group with two different workers completes
  again; a lone worker then fills groups by itself.
* **async** (``use_async``): every push is applied at once; with
  ``lr_staleness_modulation`` the learning rate is divided by the staleness
  ``version - push.version`` (when > 1).

Dense parameters use any ``torch.optim`` optimizer built by the model's
``optimizer(params)`` over this shard's parameters; embedding rows use the
matching :mod:`row optimizer <elasticdl.ps.embedding_optimizer>`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from elasticdl.common.tensor_codec import dtype_name
from elasticdl.ps.embedding_optimizer import RowOptimizer, check_finite_lr, row_optimizer_for
from elasticdl.ps.parameters import Parameters, TableSpec

logger = logging.getLogger(__name__)

OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


class NotInitializedError(RuntimeError):
    """The PS has no model yet: a worker must push_model first."""


@dataclass(frozen=True)
class ShardConfig:
    """How one PS aggregates and applies gradients."""

    ps_id: int = 0
    num_ps: int = 1
    grads_to_wait: int = 1
    use_async: bool = False
    lr_staleness_modulation: bool = False
    sync_version_tolerance: int = 0
    sync_wait_s: float = 30.0
    sync_wait_min_s: float = 1.0
    checkpoint_dir: str = ""
    checkpoint_steps: int = 0
    keep_checkpoint_max: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.ps_id < self.num_ps:
            raise ValueError(f"ps_id {self.ps_id} out of range for num_ps {self.num_ps}")
        if self.grads_to_wait < 1 or self.sync_version_tolerance < 0 or \
                not 0 <= self.sync_wait_min_s <= self.sync_wait_s:
            raise ValueError("grads_to_wait >= 1, sync_version_tolerance >= 0 and "
                             "0 <= sync_wait_min_s <= sync_wait_s are required")


@dataclass
class GradientPush:
    """One worker's gradients for this shard (already decoded). Dense gradients
    may be read-only views of received bytes: the shard never writes into them."""

    version: int
    worker_id: int = 0
    learning_rate: float = 0.0
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    sparse: list[tuple[str, np.ndarray, torch.Tensor]] = field(default_factory=list)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Group:
    """Gradients summed for the next sync version."""

    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    sparse: dict[str, list[tuple[np.ndarray, torch.Tensor]]] = field(default_factory=dict)
    count: int = 0
    workers: set[int] = field(default_factory=set)
    lr: float = 0.0
    started: float = 0.0


class PSShard:
    """One PS: parameters, optimizers, aggregation and versioning.

    Every public method is thread-safe. Validation failures raise
    ``ValueError`` (the servicer answers INVALID_ARGUMENT) and change nothing.
    """

    def __init__(self, config: ShardConfig, optimizer_factory: OptimizerFactory,
                 on_version: Optional[Callable[[PSShard], None]] = None):
        self.config = config
        self.params = Parameters(config.ps_id, config.num_ps)
        self._optimizer_factory = optimizer_factory
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.row_optimizer: Optional[RowOptimizer] = None
        self._group = _Group()
        self._peers_absent = False
        self._spread: Optional[float] = None  # EMA of first-to-last push time of a group
        self._cond = threading.Condition(threading.RLock())
        self._on_version = on_version

    # ------------------------------------------------------------ state
    @property
    def lock(self) -> threading.Condition:
        return self._cond

    @property
    def version(self) -> int:
        return self.params.version

    @property
    def initialized(self) -> bool:
        return self.params.initialized

    def initialize(self, version: int, dense: Mapping[str, torch.Tensor],
                   buffers: Mapping[str, torch.Tensor], tables: Iterable[TableSpec],
                   optimizer_state: Optional[dict] = None) -> bool:
        """Take a model; returns False (and changes nothing) when already initialised."""
        with self._cond:
            if self.params.initialized:
                return False
            self.params.initialize(version, dense, buffers, tables)
            self._build_optimizers()
            if optimizer_state is not None and self.optimizer is not None:
                self.optimizer.load_state_dict(optimizer_state)
            self._group = _Group()
            self._cond.notify_all()
            return True

    def _build_optimizers(self) -> None:
        trainable = [p for p in self.params.dense.values() if p.requires_grad]
        # a shard may hold no dense parameter; the optimizer's hyperparameters are
        # still needed for the embedding rows, so build one over a placeholder
        probe = self._optimizer_factory(trainable or [torch.nn.Parameter(torch.zeros(1))])
        if not isinstance(probe, torch.optim.Optimizer):
            raise TypeError(f"optimizer(params) returned {type(probe).__name__}, not a "
                            "torch.optim.Optimizer")
        self.optimizer = probe if trainable else None
        self.row_optimizer = row_optimizer_for(probe) if self.params.tables else None
        if self.row_optimizer is not None:
            for table in self.params.tables.values():
                self.row_optimizer.prepare(table)

    def _require_init(self) -> None:
        if not self.params.initialized:
            raise NotInitializedError(f"PS {self.config.ps_id} has no model yet (push_model)")

    # ------------------------------------------------------------- pulls
    def snapshot_dense(self, worker_version: int) -> tuple[bool, int, Optional[dict]]:
        """``(initialized, version, tensors)``; tensors is None when the worker is current.

        The tensors are the live parameters: callers hold :attr:`lock` while
        they encode them (one copy, no torn reads).
        """
        with self._cond:
            if not self.params.initialized:
                return False, self.version, None
            if worker_version == self.version:
                return True, self.version, None
            return True, self.version, {**self.params.dense, **self.params.buffers}

    def pull_embedding(self, table: str, ids: np.ndarray, create: bool = True) -> torch.Tensor:
        """Rows of ``ids`` (created lazily unless ``create`` is False); raises
        ValueError for bad ids."""
        with self._cond:
            self._require_init()
            return self.params.table(table).lookup(ids, create)

    # ------------------------------------------------------------- pushes
    def validate(self, push: GradientPush) -> None:
        """Check names, shapes and dtypes of a push against this shard.

        Raises:
            NotInitializedError: no model yet.
            ValueError: the first problem found.
        """
        self._require_init()
        p = self.params
        check_finite_lr(push.learning_rate)
        for name, grad in push.dense.items():
            param = p.dense.get(name)
            if param is None:
                raise ValueError(f"gradient for unknown parameter {name!r} on PS {p.ps_id}")
            if not param.requires_grad:
                raise ValueError(f"parameter {name!r} is not trainable ({param.dtype})")
            _check_like(f"gradient of {name!r}", grad, param)
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

    def push_gradients(self, push: GradientPush) -> tuple[bool, int]:
        """Validate and aggregate/apply a push; returns ``(accepted, version)``."""
        with self._cond:
            self.validate(push)
            for name, value in push.buffers.items():
                self.params.buffers[name].copy_(value)
            if self.config.use_async:
                staleness = self.version - push.version
                lr = push.learning_rate or None
                if self.config.lr_staleness_modulation and staleness > 1:
                    lr = (lr or self._base_lr()) / staleness
                sparse: dict[str, list[tuple[np.ndarray, torch.Tensor]]] = {}
                for table, ids, grad in push.sparse:
                    sparse.setdefault(table, []).append((ids, grad))
                self._apply(dict(push.dense), sparse, 1, lr)
                return True, self.version
            if push.version < self.version - self.config.sync_version_tolerance:
                logger.debug("rejected gradients of version %d from worker %d (now %d)",
                             push.version, push.worker_id, self.version)
                return False, self.version
            target = self._accumulate(push)
            if target is None:
                return True, self.version
            return True, self._wait_for(target, push.worker_id)

    def _accumulate(self, push: GradientPush) -> Optional[int]:
        """Add a push to the group; None if it completed the group (applied now)."""
        g = self._group
        for name, grad in push.dense.items():
            acc = g.dense.get(name)
            if acc is None:
                g.dense[name] = grad  # may be a read-only view of the received bytes
            elif g.count == 1:
                g.dense[name] = acc + grad  # a tensor of our own from now on
            else:
                acc.add_(grad)
        for table, ids, grad in push.sparse:
            g.sparse.setdefault(table, []).append((ids, grad))
        if g.count == 0:
            g.started = time.monotonic()
        g.count += 1
        g.workers.add(push.worker_id)
        g.lr = push.learning_rate or g.lr
        if g.count < self.config.grads_to_wait:
            return self.version + 1
        if len(g.workers) > 1:
            self._peers_absent = False
            spread = time.monotonic() - g.started
            self._spread = spread if self._spread is None else 0.8 * self._spread + 0.2 * spread
        self._group = _Group()
        self._apply(g.dense, g.sparse, g.count, g.lr or None)
        return None

    def _wait_for(self, target: int, worker_id: int) -> int:
        cfg = self.config
        if self._peers_absent or cfg.sync_wait_s == 0:
            return self.version
        wait_s = cfg.sync_wait_s if self._spread is None else \
            min(cfg.sync_wait_s, max(cfg.sync_wait_min_s, 10 * self._spread))
        deadline = time.monotonic() + wait_s
        while self.version < target:
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning("worker %d waited %.1f s for version %d on PS %d; not "
                               "waiting for peers until a group completes again",
                               worker_id, wait_s, target, cfg.ps_id)
                self._peers_absent = True
                break
            self._cond.wait(left)
        return self.version

    def _base_lr(self) -> float:
        if self.optimizer is not None:
            return float(self.optimizer.param_groups[0]["lr"])
        if self.row_optimizer is not None:
            return self.row_optimizer.lr
        return 0.0

    def _apply(self, dense: Mapping[str, torch.Tensor],
               sparse: Mapping[str, list[tuple[np.ndarray, torch.Tensor]]], count: int,
               lr: Optional[float]) -> None:
        """Average by ``count``, step the optimizers, bump the version (lock held)."""
        scale = 1.0 / count
        if dense and self.optimizer is not None:
            saved = [g["lr"] for g in self.optimizer.param_groups]
            if lr is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
            for name, grad in dense.items():
                param = self.params.dense[name]
                param.grad = grad * scale if count > 1 else grad  # never in place
            try:
                self.optimizer.step()
            finally:
                for group, value in zip(self.optimizer.param_groups, saved):
                    group["lr"] = value
                for param in self.params.dense.values():
                    param.grad = None
        if sparse and self.row_optimizer is not None:
            for table_name, parts in sparse.items():
                table = self.params.tables[table_name]
                ids, grad = _coalesce(parts)
                slots = table.slots(ids)
                self.row_optimizer.apply(table, slots, grad.mul_(scale), lr)
        self.params.version += 1
        self._cond.notify_all()
        if self._on_version is not None:
            self._on_version(self)

    # --------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """A consistent copy of this shard (taken under the lock)."""
        with self._cond:
            self._require_init()
            p = self.params
            return {
                "version": p.version, "ps_id": p.ps_id, "num_ps": p.num_ps,
                "dense": {n: t.detach().clone() for n, t in p.dense.items()},
                "buffers": {n: t.clone() for n, t in p.buffers.items()},
                "optimizer": self.optimizer.state_dict() if self.optimizer else None,
                "dense_order": list(p.dense),
                "tables": {n: t.state_dict() for n, t in p.tables.items()},
            }


def _check_like(what: str, value: torch.Tensor, ref: torch.Tensor) -> None:
    if value.dtype != ref.dtype:
        raise ValueError(f"{what}: dtype {dtype_name(value.dtype)} does not match "
                         f"{dtype_name(ref.dtype)}")
    if value.shape != ref.shape:
        raise ValueError(f"{what}: shape {list(value.shape)} does not match {list(ref.shape)}")


def _coalesce(parts: list[tuple[np.ndarray, torch.Tensor]]) -> tuple[np.ndarray, torch.Tensor]:
    """Sum the gradients of repeated ids; returns unique ids and their summed rows."""
    if len(parts) == 1:
        ids, grad = parts[0]
        uniq, inverse = np.unique(ids, return_inverse=True)
        if uniq.shape[0] == ids.shape[0]:
            order = np.argsort(ids, kind="stable")
            return ids[order], grad.index_select(0, torch.from_numpy(order)).clone()
    else:
        ids = np.concatenate([p[0] for p in parts])
        grad = torch.cat([p[1] for p in parts])
        uniq, inverse = np.unique(ids, return_inverse=True)
    out = torch.zeros((uniq.shape[0], grad.shape[1]), dtype=grad.dtype)
    out.index_add_(0, torch.from_numpy(inverse.reshape(-1)), grad)
    return uniq, out
