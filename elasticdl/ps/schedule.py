"""The learning-rate schedule of one parameter server.

The model module's ``lr_scheduler(optimizer)`` is built over the shard's dense
optimizer (a placeholder optimizer when the shard holds no dense parameter:
its param_groups still carry the hyperparameters the embedding rows use) and
stepped here, never undone:

* interval ``"step"``: once after every applied update (version bump). Every PS
  receives exactly one push per worker step, so all PS count the same steps;
* interval ``"epoch"``: the epochs are the master's. Every push carries its
  task's epoch; before a group of a newer epoch is applied, the scheduler
  steps once per epoch crossed. Epochs never go backwards (the master's epoch
  barrier hands out epoch e+1 only once epoch e is done);
* interval ``"evaluation"`` (``ReduceLROnPlateau``): the master decides the
  reductions at its evaluations (:mod:`elasticdl.master.lr_plateau`); every
  push carries the count its task went out with, and before a group is applied
  the shard applies the reductions it has not applied yet (counts never go
  back; a relaunched PS restores its count from its checkpoint and catches up).

Asynchronous staleness modulation scales the scheduled learning rates for one
apply (:meth:`ShardSchedule.scaled`) and restores the scheduled values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch

from elasticdl.api.model_spec import LRSchedule, ScheduleClock
from elasticdl.ps.embedding_optimizer import RowOptimizer, row_optimizer_for
from elasticdl.ps.parameters import Parameters

logger = logging.getLogger(__name__)

PLACEHOLDER = "__ps_placeholder__"   # the parameter of a shard without dense ones


class ShardSchedule(ScheduleClock):
    """An optimizer's scheduler (or none) and the epoch the shard is at."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Optional[LRSchedule],
                 ps_id: int = 0):
        if schedule is not None and schedule.interval != "evaluation" and isinstance(
                schedule.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError("ReduceLROnPlateau needs a metric at every step: return "
                             "{'scheduler': s, 'monitor': NAME} from lr_scheduler (the master "
                             "steps it at each evaluation), not an epoch or step interval")
        super().__init__(schedule)
        self.optimizer = optimizer
        self.ps_id = ps_id

    def lr(self) -> float:
        """The first param group's learning rate as scheduled now."""
        return float(self.optimizer.param_groups[0]["lr"])

    def enter_epoch(self, epoch: int) -> None:
        """A group of ``epoch`` is about to be applied."""
        if self.advance_epoch(epoch):
            logger.info("PS %d: epoch %d, learning rate %s", self.ps_id, epoch,
                        [g["lr"] for g in self.optimizer.param_groups])

    def enter_reductions(self, reductions: int) -> None:
        """A group whose pushes carry ``reductions`` master-decided LR reductions is
        about to be applied."""
        if self.catch_up_reductions(reductions):
            logger.info("PS %d: learning-rate reduction %d (metric-driven), learning rate "
                        "%s", self.ps_id, reductions,
                        [g["lr"] for g in self.optimizer.param_groups])

    def catch_up_steps(self, updates: int) -> None:
        """The shard took a model at version ``updates`` without a schedule state
        (a PS relaunched without a checkpoint takes a worker's model): a "step"
        scheduler steps that many times, as the other PS did (one step per applied
        update; versions count updates from 0 when there was no rollback, which
        needs a checkpoint). An "epoch" one catches up at the next push."""
        if self.interval != "step" or updates <= 0:
            return
        for _ in range(updates):
            self._step()
        logger.info("PS %d: step schedule caught up with %d applied updates, learning rate "
                    "%s", self.ps_id, updates, [g["lr"] for g in self.optimizer.param_groups])

    @contextmanager
    def scaled(self, factor: float) -> Iterator[None]:
        """Every group's learning rate times ``factor`` inside; the scheduled values after."""
        if factor == 1.0:
            yield
            return
        groups = self.optimizer.param_groups
        scheduled = [g["lr"] for g in groups]
        for g, lr in zip(groups, scheduled):
            g["lr"] = lr * factor
        try:
            yield
        finally:
            for g, lr in zip(groups, scheduled):
                g["lr"] = lr

    # --------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "interval": self.interval,
                "lr_reductions": self.reductions,
                "lrs": [float(g["lr"]) for g in self.optimizer.param_groups],
                "scheduler": self.schedule.scheduler.state_dict()
                if self.schedule is not None else None}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """Restore the epoch, the scheduler and the scheduled learning rates
        (after the optimizer's own state was loaded)."""
        if not state:
            return
        self.epoch = int(state.get("epoch", 0))
        self.reductions = int(state.get("lr_reductions", 0))
        if self.schedule is not None and state.get("scheduler") is not None:
            self.schedule.scheduler.load_state_dict(state["scheduler"])
        elif self.schedule is not None:
            logger.warning("PS %d: the checkpoint has no scheduler state; the schedule "
                           "starts over", self.ps_id)
        lrs = state.get("lrs") or []
        groups = self.optimizer.param_groups
        if len(lrs) == len(groups):
            for g, lr in zip(groups, lrs):
                g["lr"] = lr
        else:
            logger.warning("PS %d: the checkpoint has %d param groups, the optimizer %d; "
                           "learning rates are the first group's scheduled one", self.ps_id,
                           len(lrs), len(groups))
            for g in groups:
                g["lr"] = lrs[0] if lrs else g["lr"]


def build_optimizers(params: Parameters,
                     make_optimizer: Callable[[list[tuple[str, Any]]], Any],
                     make_scheduler: Optional[Callable[[Any], Optional[LRSchedule]]],
                     ps_id: int) -> tuple[Optional[torch.optim.Optimizer],
                                          Optional[RowOptimizer], ShardSchedule]:
    """The shard's optimizer over its named trainable parameters (None when it
    has none), its embedding rows' optimizer and its schedule.

    A shard may hold no dense parameter; the optimizer's hyperparameters and
    schedule are still needed for the embedding rows: a placeholder then.

    Raises:
        ValueError: no optimizer or scheduler can be built, or the optimizer has
            no row-wise version while there are tables (the message names them).
    """
    trainable = [(n, p) for n, p in params.dense.items() if p.requires_grad]
    named = trainable or [(PLACEHOLDER, torch.nn.Parameter(torch.zeros(1)))]
    try:
        probe = make_optimizer(named)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"PS {ps_id}: the model's optimizer(params) failed: "
                         f"{type(e).__name__}: {e}") from e
    if not isinstance(probe, torch.optim.Optimizer):
        raise ValueError(f"PS {ps_id}: the model's optimizer(params) returned "
                         f"{type(probe).__name__}, not a torch.optim.Optimizer")
    try:
        schedule = ShardSchedule(probe, make_scheduler(probe) if make_scheduler else None,
                                 ps_id)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"PS {ps_id}: the model's lr_scheduler(optimizer) failed: "
                         f"{type(e).__name__}: {e}") from e
    row_optimizer = None
    if params.tables:
        try:
            row_optimizer = row_optimizer_for(probe)
        except ValueError as e:
            raise ValueError(f"embedding table(s) {sorted(params.tables)}: optimizer "
                             f"{type(probe).__name__} has no row-wise version ({e})") from e
        for table in params.tables.values():
            row_optimizer.prepare(table)
    return (probe if trainable else None), row_optimizer, schedule
