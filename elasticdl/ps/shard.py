"""The state machine of one parameter server, without gRPC.

:class:`PSShard` validates pushes and pulls, aggregates gradients and applies
them with the model module's optimizer:

* **sync** (default): gradients computed on a version older than
  ``version - sync_version_tolerance`` are rejected (the worker recomputes on
  fresh parameters); accepted pushes are summed, weighted by their record
  counts, until ``grads_to_wait`` of them arrived, then applied as the
  per-record average (what one process gets on the union batch), and the
  version is bumped. A push returns only once the group it joined was
  applied, so "accepted" means applied. The wait adapts: 10x the usual
  spread between a group's first and last push, clamped to
  ``[sync_wait_min_s, sync_wait_s]`` (the cap until a first group completed)
  and doubled after each wait that expired. When it expires (a peer died, or
  the epoch's remaining work cannot fill the group) the incomplete group is
  applied as it is - never dropped - and later pushes are applied at once
  until two different workers push again.
* **async** (``use_async``): every push is applied at once; with
  ``lr_staleness_modulation`` the scheduled learning rates are divided by the
  staleness ``version - push.version`` (when > 1) for that one apply.

Exactly once: a push's identity ``(task_id, minibatch)`` is applied at most
once (:mod:`~elasticdl.common.ledger`); a repeat is answered ``duplicate``.
Gradients must be finite, and the learning rate is the optimizer's: a push
that tries to set it is rejected.

Dense parameters use any ``torch.optim`` optimizer built by the model's
``optimizer(named_params)`` over this shard's (named) parameters, stepped by
the model's ``lr_scheduler`` (:mod:`~elasticdl.ps.schedule`); embedding rows
use the matching :mod:`row optimizer <elasticdl.ps.embedding_optimizer>`,
which reads the optimizer's current hyperparameters at every apply. Each
push's gradients are multiplied by its ``grad_scale`` (the worker's
global-norm clip coefficient) before aggregation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import torch

from elasticdl.api.model_spec import LRSchedule, ModelSpec
from elasticdl.common.intervals import IntervalSet
from elasticdl.common.ledger import AppliedLedger
from elasticdl.common.tables import TableSpec
from elasticdl.ps.audit import AuditLog
from elasticdl.ps.embedding_optimizer import RowOptimizer, refresh_row_optimizer
from elasticdl.ps.eviction import EmbeddingDefaults
from elasticdl.ps.parameters import Parameters
from elasticdl.ps.push import GradientPush, Group, PushResult, coalesce, validate
from elasticdl.ps.row_snapshot import CheckpointChain
from elasticdl.ps.schedule import ShardSchedule, build_optimizers

logger = logging.getLogger(__name__)

OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Optional[LRSchedule]]


class NotInitializedError(RuntimeError):
    """The PS has no model yet: a worker must push_model first."""


class RollbackPendingError(RuntimeError):
    """A relaunched PS waits for the master's rollback before it serves training."""


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
    full_checkpoint_every: int = 8   # every Nth checkpoint whole, the others deltas
    minibatch_size: int = 0   # records per minibatch: a ledger's minibatch k starts at
    #                           (k - 1) * minibatch_size in its task (data position)
    embedding: EmbeddingDefaults = EmbeddingDefaults()   # admission/eviction defaults
    table_log_every: int = 1000   # versions between two admission/eviction log lines

    def __post_init__(self) -> None:
        if not 0 <= self.ps_id < self.num_ps:
            raise ValueError(f"ps_id {self.ps_id} out of range for num_ps {self.num_ps}")
        if self.full_checkpoint_every < 1:
            raise ValueError("full_checkpoint_every >= 1 is required")
        if self.grads_to_wait < 1 or self.sync_version_tolerance < 0 or \
                not 0 <= self.sync_wait_min_s <= self.sync_wait_s:
            raise ValueError("grads_to_wait >= 1, sync_version_tolerance >= 0 and "
                             "0 <= sync_wait_min_s <= sync_wait_s are required")


class PSShard:
    """One PS: parameters, optimizers, aggregation, versioning and the ledger.

    Every public method is thread-safe. Validation failures raise
    ``ValueError`` (the servicer answers INVALID_ARGUMENT) and change nothing.
    """

    def __init__(self, config: ShardConfig,
                 optimizer_factory: Union[ModelSpec, OptimizerFactory],
                 on_version: Optional[Callable[[PSShard], None]] = None,
                 lr_scheduler: Optional[SchedulerFactory] = None):
        """``optimizer_factory``: the model's :class:`ModelSpec` (its
        ``make_optimizer`` over named parameters and ``make_lr_scheduler``), or a
        plain ``optimizer(params)`` callable with an optional ``lr_scheduler``."""
        self.config = config
        self.params = Parameters(config.ps_id, config.num_ps, config.embedding)
        self._spec = optimizer_factory if isinstance(optimizer_factory, ModelSpec) else None
        self._optimizer_factory = optimizer_factory
        self._scheduler_factory = lr_scheduler if lr_scheduler is not None or \
            self._spec is None else self._spec.make_lr_scheduler
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.row_optimizer: Optional[RowOptimizer] = None
        self.schedule: Optional[ShardSchedule] = None
        self.ledger = AppliedLedger()
        self.audit: Optional[AuditLog] = None   # every applied push, on disk (--output)
        self.duplicates_ignored = 0
        self._group = Group()
        self._peers_absent = False
        self._absent_seen: set[int] = set()
        self._live_workers = 0   # running workers per the master (0: unknown)
        self._sync_group = 0     # async, after a divergence rollback: the pushes' group
        self._spread: Optional[float] = None  # EMA of first-to-last push time of a group
        self._wait_scale = 1.0
        self._cond = threading.Condition(threading.RLock())
        self._on_version = on_version
        self.last_checkpoint_version = 0   # the version last written (or restored)
        self.chain = CheckpointChain()     # the full + deltas this PS writes (a restore: none)
        self.checkpoint_writer: Any = None  # the background writer (shard_checkpoint)
        self.awaiting_rollback = False  # set by a relaunched PS until the master rolls back
        self.job_spec: Any = None       # the job (restore rule checks of rollback requests)
        # called (shard lock held) once a worker's pushed model initialised this PS
        self.on_model_pushed: Optional[Callable[[PSShard], None]] = None
        # the last rollback's (protocol id, master incarnation, new version) and answer
        self._last_rollback: Optional[tuple[tuple[int, int, int], list]] = None

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
                   optimizer_state: Optional[dict] = None,
                   ledger: Optional[dict] = None,
                   lr_schedule_state: Optional[dict] = None) -> bool:
        """Take a model; returns False (and changes nothing) when already initialised.

        All or nothing: the parameters are taken only once the optimizers were
        built for them.

        Raises:
            ValueError: misplaced or duplicate names, or no optimizer can be built
                (the message names the optimizer and the table).
        """
        with self._cond:
            if self.params.initialized:
                return False
            params = Parameters(self.config.ps_id, self.config.num_ps,
                                     self.config.embedding)
            params.initialize(version, dense, buffers, tables)
            optimizer, row_optimizer, schedule = self._build_optimizers(params)
            if optimizer_state is not None and optimizer is not None:
                optimizer.load_state_dict(optimizer_state)
            if lr_schedule_state is None:
                schedule.catch_up_steps(version)
            else:
                schedule.load_state_dict(lr_schedule_state)
            self.params, self.optimizer, self.row_optimizer = params, optimizer, row_optimizer
            self.schedule = schedule
            self.ledger.load_state_dict(ledger)
            if self.audit is not None:   # the audit trail follows the restored history
                self.audit.truncate_after(params.version)
            self.last_checkpoint_version = params.version
            self.chain = CheckpointChain()   # the next checkpoint is whole
            self._drop_group()
            self._cond.notify_all()
            logger.info("PS %d initialised at version %d: %d dense, %d tables, %d applied "
                        "pushes in the ledger", self.config.ps_id, params.version,
                        len(params.dense), len(params.tables), len(self.ledger))
            return True

    def _build_optimizers(self, params: Parameters) -> tuple[
            Optional[torch.optim.Optimizer], Optional[RowOptimizer], ShardSchedule]:
        spec, factory = self._spec, self._optimizer_factory

        def make(named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
            if spec is not None:
                return spec.make_optimizer(named)
            return factory([p for _, p in named])  # type: ignore[operator]

        return build_optimizers(params, make, self._scheduler_factory, self.config.ps_id)

    def _require_init(self) -> None:
        if self.awaiting_rollback:
            raise RollbackPendingError(f"PS {self.config.ps_id} is waiting for the master's "
                                       "rollback")
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
            self._require_init()
            if worker_version == self.version:
                return True, self.version, None
            return True, self.version, {**self.params.dense, **self.params.buffers}

    def pull_embedding(self, table: str, ids: np.ndarray, create: bool = True) -> torch.Tensor:
        """Rows of ``ids`` (created lazily unless ``create`` is False); raises
        ValueError for bad ids."""
        with self._cond:
            self._require_init()
            return self.params.table(table).lookup(ids, create)

    def export_rows(self, table: str, max_rows: int) -> Iterator[tuple[np.ndarray,
                                                                      torch.Tensor]]:
        """Pages of at most ``max_rows`` rows of ``table`` that exist here, ids ascending
        (the order is taken now, checks raise now; each page is copied under the lock
        as it is read, so the extra memory is one id array and one page, never a copy
        of the table)."""
        with self._cond:
            self._require_init()
            t = self.params.table(table)
            ids = t.row_ids[:t.size]
            ids = np.sort(ids[ids >= 0])   # evicted slots hold -1

        def pages() -> Iterator[tuple[np.ndarray, torch.Tensor]]:
            for start in range(0, ids.shape[0], max_rows):
                page = ids[start:start + max_rows]
                with self._cond:
                    current = self.params.table(table)
                    found = current.find(page)
                    if (found < 0).any():   # evicted since the order was taken
                        page, found = page[found >= 0], found[found >= 0]
                    rows = current.weights.index_select(0, torch.from_numpy(found))
                yield page, rows

        return pages()

    def applied(self, task_ids: Optional[Iterable[int]] = None
                ) -> tuple[int, list[tuple[int, int, int, int]]]:
        """``(version, ledger entries)`` of some tasks (None: all), in order."""
        with self._cond:
            return self.version, list(self.ledger.entries(task_ids))

    def applied_and_closed(self, task_ids: Optional[Iterable[int]] = None
                           ) -> tuple[int, list[tuple[int, int, int, int]], IntervalSet]:
        """``(version, live ledger entries, closed tasks)`` of some tasks (None: all);
        O(the tasks asked for) when given."""
        with self._cond:
            ids = None if task_ids is None else list(task_ids)
            return self.version, list(self.ledger.entries(ids)), self.ledger.closed_of(ids)

    def settle(self, generation: int, closed: IntervalSet) -> Optional[int]:
        """The master closed ``closed`` (at rollback version ``generation``): fold
        their ledger entries; None when ignored (an older generation than this PS
        rolled back to, or a PS waiting for its rollback)."""
        with self._cond:
            if self.awaiting_rollback:
                return None
            return self.ledger.settle(generation, closed)

    # ------------------------------------------------------------- pushes
    def push_gradients(self, push: GradientPush) -> PushResult:
        """Validate and aggregate/apply a push."""
        with self._cond:
            self._require_init()
            if push.discard:  # an overflowed fp16 step: counts, applies nothing
                push.dense, push.sparse = {}, []
            validate(self.params, push)
            ident = push.identity
            if ident is not None and self.ledger.seen(*ident):
                self.duplicates_ignored += 1
                logger.info("PS %d: push (task %d, minibatch %d) from worker %d was applied "
                            "before; ignored", self.config.ps_id, ident[0], ident[1],
                            push.worker_id)
                return PushResult(True, self.version, True, self._lr())
            if self.config.use_async and push.sync_group:
                # --divergence_sync: after a divergence rollback an async job's PS apply
                # synchronous groups of the live workers (the master's count)
                self._sync_group = push.sync_group
            elif self.config.use_async:
                self._copy_buffers(push)
                staleness = self.version - push.version
                factor = 1.0
                if self.config.lr_staleness_modulation and staleness > 1:
                    factor = 1.0 / staleness
                g = Group()
                g.add(push)
                self._apply_group(g, factor)
                return PushResult(True, self.version, False, g.learning_rate)
            self._note_peer(push.worker_id)
            if push.version < self.version - self.config.sync_version_tolerance:
                logger.debug("rejected gradients of version %d from worker %d (now %d)",
                             push.version, push.worker_id, self.version)
                return PushResult(False, self.version, False, self._lr())
            self._copy_buffers(push)   # only an accepted push's statistics (BatchNorm)
            g = self._group
            if ident is not None and ident in g.identities:  # a repeat of a pending push
                self.duplicates_ignored += 1
                return self._wait(g, push.worker_id, duplicate=True)
            g.add(push)
            if g.count >= self._group_target() or self._peers_absent:
                self._complete(g)
                return PushResult(True, self.version, False, g.learning_rate)
            return self._wait(g, push.worker_id)

    def _copy_buffers(self, push: GradientPush) -> None:
        for name, value in push.buffers.items():
            self.params.buffers[name].copy_(value)

    def _group_target(self) -> int:
        """Pushes per group: ``grads_to_wait``, or fewer while fewer workers run; an
        async PS told to group (``sync_group`` of the pushes): that many."""
        if self.config.use_async:
            return max(1, self._sync_group)
        live = self._live_workers
        return min(self.config.grads_to_wait, live) if live > 0 else self.config.grads_to_wait

    def set_live_workers(self, n: int) -> None:
        """The job's running workers (elasticdl.ps.group_size); a pending group
        that is now complete is applied."""
        with self._cond:
            self._live_workers = max(0, int(n))
            g = self._group
            if g.count and not g.done and g.count >= self._group_target():
                self._complete(g)
                self._cond.notify_all()

    def _note_peer(self, worker_id: int) -> None:
        """In "peers absent" mode, two different workers pushing end it."""
        if self._peers_absent:
            self._absent_seen.add(worker_id)
            if len(self._absent_seen) > 1:
                logger.info("PS %d: several workers push again; waiting for full groups",
                            self.config.ps_id)
                self._peers_absent = False

    def _wait(self, g: Group, worker_id: int, duplicate: bool = False) -> PushResult:
        """Wait until group ``g`` was applied; apply it as it is when the wait expires."""
        cfg = self.config
        wait_s = cfg.sync_wait_s if self._spread is None else \
            min(cfg.sync_wait_s, max(cfg.sync_wait_min_s, 10 * self._spread))
        wait_s = min(cfg.sync_wait_s, wait_s * self._wait_scale)
        deadline = time.monotonic() + wait_s
        while not g.done:
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning("worker %d waited %.1f s for a group of %d on PS %d; applying "
                               "the %d push(es) there are, and not waiting for peers until "
                               "two workers push again", worker_id, wait_s,
                               self._group_target(), cfg.ps_id, g.count)
                self._peers_absent = True
                self._absent_seen = set()
                self._wait_scale = min(8.0, self._wait_scale * 2)
                self._complete(g)
                break
            self._cond.wait(left)
        return PushResult(not g.dropped, self.version, duplicate,
                          g.learning_rate if g.done and not g.dropped else self._lr())

    def _complete(self, g: Group) -> None:
        """Apply the pending group ``g`` (lock held)."""
        if len(g.workers) > 1 and g.count >= self._group_target():
            spread = time.monotonic() - g.started
            self._spread = spread if self._spread is None else 0.8 * self._spread + 0.2 * spread
            self._wait_scale = 1.0
        self._group = Group()
        self._apply_group(g, 1.0)

    def _drop_group(self) -> None:
        """Discard the pending group (rollback, re-initialisation); its pushes answer
        not accepted, so their workers push them again."""
        g = self._group
        if g.count:
            logger.warning("PS %d: %d pending push(es) discarded", self.config.ps_id, g.count)
        g.done = g.dropped = True
        self._group = Group()
        self._cond.notify_all()

    def _lr(self) -> float:
        """The first param group's learning rate as scheduled now (0: no model)."""
        return self.schedule.lr() if self.schedule is not None else 0.0

    def _apply_group(self, g: Group, lr_factor: float) -> None:
        """Step the optimizers with the record-weighted average of ``g`` (learning
        rates as scheduled, times ``lr_factor`` and the group's ``lr_scale`` for this
        apply only), step the
        scheduler, bump the version, record its identities (lock held)."""
        schedule = self.schedule
        assert schedule is not None  # initialised
        schedule.enter_epoch(g.epoch)
        schedule.enter_reductions(g.lr_reductions)
        scale = g.weight0 / g.total if g.total else 1.0
        # lr_scale: --on_divergence=rollback's cut, on top of the schedule (master's)
        with schedule.scaled(lr_factor * g.lr_scale):
            g.learning_rate = schedule.lr()
            if g.dense:
                if self.optimizer is None:
                    raise RuntimeError(f"PS {self.config.ps_id} has dense gradients but no "
                                       "optimizer")
                for name, grad in g.dense.items():
                    param = self.params.dense[name]
                    param.grad = grad * scale if scale != 1.0 else grad  # never in place
                try:
                    self.optimizer.step()
                finally:
                    for param in self.params.dense.values():
                        param.grad = None
            if g.sparse:
                if self.row_optimizer is None:
                    raise RuntimeError(f"PS {self.config.ps_id} has embedding gradients but "
                                       "no row optimizer")
                refresh_row_optimizer(self.row_optimizer, schedule.optimizer)
                for table_name, parts in g.sparse.items():
                    table = self.params.tables[table_name]
                    ids, grad = coalesce(parts)
                    keep, slots = table.slots_for_update(ids)
                    if keep is not None:   # admission: ids without a row only count
                        grad = grad[torch.from_numpy(keep)]
                    table.before_update(slots)   # the next delta; a snapshot copies first
                    self.row_optimizer.apply(table, slots, grad.mul_(scale))
                    table.touch(slots)
        schedule.after_update()
        self.params.version += 1
        self._table_upkeep()
        for (task, minibatch), records in g.identities.items():
            self.ledger.add(task, minibatch, records, self.params.version)
            if self.audit is not None:
                self.audit.append(task, minibatch, records, self.params.version)
        g.done = True
        self._cond.notify_all()
        if self._on_version is not None:
            self._on_version(self)

    def _table_upkeep(self) -> None:
        """After each version (lock held): the tables' clocks, one step of each TTL
        sweep, and now and then a log line of admissions and evictions."""
        version = self.params.version
        self.params.set_clock(version)
        for table in self.params.tables.values():
            table.sweep()
        every = self.config.table_log_every
        if every > 0 and version % every == 0:
            for name, t in self.params.tables.items():
                if t.policy.admits or t.policy.evicts:
                    logger.info("PS %d table %r at version %d: %d rows; %d slots, %.1f MB; "
                                "admitted %d, evicted %d (ttl) %d (capacity), gradients of ids "
                                "without a row dropped %d", self.config.ps_id, name, version,
                                t.live_rows, t.size, t.nbytes / 2**20,
                                t.stats["admitted"], t.stats["evicted_ttl"],
                                t.stats["evicted_capacity"], t.stats["grads_dropped"])

    def rollback_answer(self, key: tuple[int, int, int]
                        ) -> Optional[list[tuple[int, int, int, int]]]:
        """The answer of the rollback ``key`` if it was the last one done here."""
        with self._cond:
            last = self._last_rollback
            return list(last[1]) if last is not None and last[0] == key else None

    def rollback(self, restore: Callable[[PSShard], int], new_version: int,
                 key: Optional[tuple[int, int, int]] = None
                 ) -> list[tuple[int, int, int, int]]:
        """Replace the state by ``restore(self)`` (e.g. a checkpoint) and continue
        numbering versions at ``new_version``; returns the restored ledger
        (remembered under ``key``, see :meth:`rollback_answer`)."""
        with self._cond:
            if new_version <= self.version:
                raise ValueError(f"new_version {new_version} must exceed PS "
                                 f"{self.config.ps_id}'s current version {self.version} "
                                 "(versions never repeat)")
            self._drop_group()
            self.awaiting_rollback = False
            self.params = Parameters(self.config.ps_id, self.config.num_ps,
                                     self.config.embedding)
            self.optimizer = self.row_optimizer = None
            self.schedule = None
            restored = restore(self)
            if new_version <= restored:
                raise ValueError(f"new_version {new_version} must exceed the restored "
                                 f"version {restored} (versions never repeat)")
            self.params.version = new_version
            self.params.set_clock(new_version)
            self.ledger.generation = new_version   # older settle messages are ignored now
            self._cond.notify_all()
            logger.warning("PS %d rolled back to checkpoint version %d; versions continue "
                           "at %d", self.config.ps_id, restored, new_version)
            entries = list(self.ledger.entries())
            if key is not None:
                self._last_rollback = (key, entries)
            return entries

    # --------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """A consistent copy of this shard (taken under the lock)."""
        with self._cond:
            self._require_init()
            if self.audit is not None:   # what this checkpoint holds is on disk
                self.audit.flush()
            p = self.params
            return {
                "version": p.version, "ps_id": p.ps_id, "num_ps": p.num_ps,
                "dense": {n: t.detach().clone() for n, t in p.dense.items()},
                "buffers": {n: t.clone() for n, t in p.buffers.items()},
                "optimizer": self.optimizer.state_dict() if self.optimizer else None,
                "dense_order": list(p.dense),
                "tables": {n: t.state_dict() for n, t in p.tables.items()},
                "ledger": self.ledger.state_dict(),
                "lr_schedule": self.schedule.state_dict() if self.schedule else None,
            }
