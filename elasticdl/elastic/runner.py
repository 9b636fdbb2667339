"""Elastic allreduce: the retry-and-restore loop, written once.

Every training step of an elastic allreduce job is a *round* that all members
of the current group run together (:meth:`ElasticRunner.run_round`):

* the round starts with an asynchronous all-reduce of a few *meta* numbers —
  ``[records, plan change seen, leaving]`` — that completes while forward and
  backward run (no extra waiting point compared to torch DDP);
* the step function runs on this member's microbatches; backward hooks
  all-reduce gradient buckets as they become ready
  (:class:`~elasticdl.elastic.grad_sync.GradientAllreducer`), weighted by records and
  divided by the round's total ``N``, so the update equals single-process
  training on the union of the round's records. A member without data runs the
  same step function on a *filler* batch (its last batch, or one received from a
  member with data) with weight 0, so every member issues the same collectives
  and runs the same user code — clipping, LR scheduler, GradScaler — every step
  (issue 10, item 5: a member never falls back to a bare ``optimizer.step()``);
  when nobody had data (``N == 0``) the optimizer step is skipped everywhere
  (an idle round) and buffers moved by filler forwards are restored;
* the round's completion proves every member finished the previous round, so
  the steps before it are *confirmed* (in every member's model). A plan change
  seen by any member (a worker joined or left) makes every member re-form the
  group after the round; ``leaving`` (the master has no more tasks) ends training.

When a collective fails or times out (:class:`CollectiveError`), the runner
destroys the group, reports to the master, waits for the next plan, forms the
new group and broadcasts model, optimizer and counters (:class:`ElasticState`)
from the member with the highest model version. The round is then retried —
unless the survivors' state shows it already took effect (a member completed it
before the failure), in which case it counts as done. A member that had to
join again (it was left out of a plan) cannot trust that its unconfirmed steps
survived: those the adopted model does not hold (per its ``trained`` records)
are handed back through ``on_lost`` to be trained again.

The meta all-reduce also carries the identities (task, minibatch) of every
member's microbatches, so each member records, for every step that took effect
on it, which minibatches of *every* member its model holds
(:mod:`elasticdl.elastic.trained`) — what lets a task re-queued after its holder
died skip the minibatches already in the model.

The step function may run more than once for the same batch (retries); keep
counts that must survive membership changes in ``ElasticState.counters``.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from elasticdl.common import collective
from elasticdl.common.collective import CollectiveError, broadcast_state, guard
from elasticdl.common.elastic_state import (
    ElasticState,
    Microbatch,
    RoundResult,
    RoundStatus,
    StepAborted,
    StepFn,
)
from elasticdl.elastic.grad_sync import GradientAllreducer
from elasticdl.elastic.group import ElasticGroup
from elasticdl.elastic.sparse_sync import sparse_grad_params
from elasticdl.elastic.trained import TrainedRecords

logger = logging.getLogger(__name__)

__all__ = ["ElasticState", "ElasticRunner", "RoundResult", "RoundStatus", "StepAborted",
           "CollectiveError", "Microbatch"]


def _reductions_of(tag: Any) -> int:
    """The LR reductions a microbatch's task carried (``BatchTag.lr_reductions``), or 0."""
    return int(getattr(tag, "lr_reductions", 0) or 0)


def _epoch_of(tag: Any) -> int:
    """The master's epoch of a microbatch's task (``BatchTag.epoch``), or -1."""
    epoch = getattr(tag, "epoch", None)
    return int(epoch) if epoch is not None else -1


class ElasticRunner:
    """Runs rounds over an :class:`ElasticGroup`; see the module docs.

    Args:
        state: what is broadcast after membership changes.
        group: this worker's elastic group.
        device: where header and state buffers live.
        global_microbatches: with ``--fixed_global_batch_size``, the number of
            minibatches in every step (``--num_workers``), spread over the
            members (gradient accumulation when fewer are present); 0: one
            minibatch per member and step.
        max_failures: consecutive failed attempts of one round before giving up.
        on_confirmed / on_lost: called with the tags of microbatches whose step
            is confirmed on every member / was lost and must be trained again.
        on_round: called after every round with the result.
        trained: where every member's minibatches of each step that takes effect
            are recorded (their identities ride on the step's meta all-reduce; see
            :mod:`elasticdl.elastic.trained`); register it in ``state`` so it
            travels with the model. None: not tracked.
    """

    def __init__(self, state: ElasticState, group: ElasticGroup, device: torch.device,
                 global_microbatches: int = 0, max_failures: int = 10,
                 on_confirmed: Optional[Callable[[list[Any]], None]] = None,
                 on_lost: Optional[Callable[[list[Any]], None]] = None,
                 on_round: Optional[Callable[[RoundResult], None]] = None,
                 trained: Optional[TrainedRecords] = None):
        self.state = state
        self.group = group
        self.device = device
        self.global_microbatches = global_microbatches
        self.max_failures = max_failures
        self.on_confirmed = on_confirmed
        self.on_lost = on_lost
        self.on_round = on_round
        self.trained = trained
        self.step_fn: Optional[StepFn] = None
        # called in optimizer.step() once the step's gradients are reduced (identical
        # on every member): before_step may clip, unscale or step a scheduler and
        # returns False to skip the update; after_step(applied) follows the update
        self.before_step: Optional[Callable[[], bool]] = None
        self.after_step: Optional[Callable[[bool], None]] = None
        self.grads = GradientAllreducer(state.model.parameters(), state.model.buffers(),
                                        sparse=sparse_grad_params(state.model))
        self.confirmed_version = 0
        self.is_filler = False
        self.recoveries = 0
        self._pending: list[Microbatch] = []
        self._unconfirmed: list[tuple[int, list[Any]]] = []
        self._filler: Optional[tuple[Any, ...]] = None
        self._need_fillers = True   # some member may lack a filler (same on every member)
        self._phase: Optional[tuple[bool, bool]] = None   # (first, last) microbatch of a step
        self._orig_step: Callable[..., Any] = state.optimizer.step
        self._started = False
        self._install_gate(state.optimizer)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Join the group and take the state of the most advanced member."""
        if not self._started:
            self._started = True
            self._reform()

    def close(self) -> None:
        if self.group.active:
            self.group.leave()

    @property
    def quota(self) -> int:
        """Minibatches this member contributes to a step."""
        n = self.global_microbatches
        if n <= 0:
            return 1
        w, r = self.group.world_size, self.group.rank
        return max(1, n // w + (1 if r < n % w else 0))

    @property
    def pending(self) -> int:
        return len(self._pending)

    # ---------------------------------------------------------------- steps
    def submit(self, fn: StepFn, args: tuple[Any, ...], records: int,
               tag: Any = None) -> Optional[RoundResult]:
        """Add a microbatch; run the round once this member's quota is reached.

        Returns the round's result, or None while accumulating.
        """
        self.step_fn = fn
        self.start()
        self._pending.append(Microbatch(tuple(args), int(records), tag))
        if len(self._pending) < self.quota:
            return None
        return self.flush()

    def flush(self) -> RoundResult:
        """Run a round with the pending microbatches (none: contribute zeros / idle)."""
        self.start()
        micro, self._pending = self._pending, []
        return self.run_round(micro)

    def leave_round(self) -> RoundResult:
        """Tell the group this member is leaving (the master has no more tasks)."""
        self.start()
        if self._pending:
            raise RuntimeError("leave_round() with microbatches pending; flush() first")
        return self.run_round([], leaving=True)

    def run_round(self, micro: Sequence[Microbatch], leaving: bool = False) -> RoundResult:
        """One step of the group, retried through membership changes (module docs)."""
        failures = 0
        while True:
            start_version = self.state.model_version
            try:
                if not self.group.active:
                    self._reform()
                outputs, total, change, done, block = self._compute(micro, leaving)
            except CollectiveError as e:
                logger.info("collective failed: %s", str(e)[:200])
                self._reset()
                failures += 1
                self.recoveries += 1
                self.group.fail(str(e))
                continuous = self._reform()
                if continuous and self.state.model_version > start_version:
                    logger.info("round at version %d completed on a member before the "
                                "failure; it counts", start_version)
                    result = self._stepped(micro, [], start_version, recovered=True)
                    self._confirm(self.state.model_version)  # it is in the adopted state
                    return result
                if failures >= self.max_failures:
                    raise
                logger.info("retrying the round at version %d (attempt %d)",
                            self.state.model_version, failures + 1)
                continue
            except BaseException:
                self._reset()
                raise
            self._confirm(start_version)
            if total > 0:
                self.state.model_version += 1
                if self.trained is not None:
                    self.trained.record(block)
                result = self._stepped(micro, outputs, start_version)
            else:
                result = self._finish(RoundResult(RoundStatus.IDLE, start_version))
            if done:
                return self._finish(RoundResult(RoundStatus.DONE, self.state.model_version))
            if change:
                logger.info("plan change seen at version %d; re-forming",
                            self.state.model_version)
                self.group.leave()
                self._reform()
            return result

    def _reset(self) -> None:
        collective.defer_dispose(self.grads.abandon())  # disposed after the group
        self._phase = None
        self.is_filler = False

    def _stepped(self, micro: Sequence[Microbatch], outputs: list[Any],
                 start_version: int, recovered: bool = False) -> RoundResult:
        tags = [m.tag for m in micro]
        if micro:
            self._unconfirmed.append((start_version + 1, tags))
        return self._finish(RoundResult(RoundStatus.STEPPED, self.state.model_version,
                                        outputs, tags, recovered))

    def _finish(self, result: RoundResult) -> RoundResult:
        if self.on_round is not None:
            self.on_round(result)
        return result

    # ------------------------------------------------------------- internals
    def _compute(self, micro: Sequence[Microbatch],
                 leaving: bool) -> tuple[list[Any], float, bool, bool, list[float]]:
        records = sum(m.records for m in micro)
        if micro and self.step_fn is None:
            raise RuntimeError("no step function: wrap one with ctx.step(fn) before the loop")
        if self._need_fillers:
            self._exchange_fillers(micro)
        meta = [float(records), float(self.group.change_pending()), float(leaving)]
        # the epoch of the step, agreed: each member's 1 + max epoch of its microbatches
        # (0: none known) in its own slot; every member reads the same maximum
        epochs = [0.0] * self.group.world_size
        known = [_epoch_of(m.tag) for m in micro if m.records > 0]
        epochs[self.group.rank] = float(max(known) + 1) if known else 0.0
        meta += epochs
        # likewise the metric-driven LR reductions (the master's count): the maximum
        # any member's task carried, applied by every member at this very step
        reductions = [0.0] * self.group.world_size
        reductions[self.group.rank] = float(max((_reductions_of(m.tag) for m in micro
                                                 if m.records > 0), default=0))
        meta += reductions
        if self.trained is not None:  # who trains what: [world, slots, 4], own row filled
            meta += self.trained.encode([m.tag for m in micro], self.group.rank,
                                        self.group.world_size, max(self.global_microbatches, 1))
        self.grads.begin(meta)
        plan = list(micro)
        if not plan and self._filler is not None and self.step_fn is not None:
            plan = [Microbatch(self._filler, 0)]
        outputs: list[Any] = []
        prev = 0.0
        for j, m in enumerate(plan):
            scale = float(m.records)
            last = j == len(plan) - 1
            if j > 0 and scale > 0 and prev != scale:
                # keep .grad == (sum of records_i * grad_i) / records_j  (see grad_sync)
                with torch.no_grad():
                    for p in self.grads.params:
                        if p.grad is not None:
                            p.grad.mul_(prev / scale)
            if last:
                self.grads.arm(scale)
            self._phase = (j == 0, last)
            self.is_filler = m.records == 0
            assert self.step_fn is not None
            out = self.step_fn(*m.args)
            if m.records:
                outputs.append(out)
            prev = scale
        self.grads.end_step()
        self._phase = None
        self.is_filler = False
        if not plan:  # nobody had data (else the filler exchange gave us one): zeros
            total = self.grads.finish()[0]
            if total > 0:
                raise RuntimeError("a member without data and filler in a step with data; "
                                   "the filler exchange failed")
        elif self.grads.active:
            logger.warning("the step function ran no backward()/optimizer.step(); gradients "
                           "were reduced after it returned and no step was applied")
            self.grads.finish()
        total, change, done = self.grads.result[:3]
        if micro:
            self._filler = micro[-1].args
        return (outputs, total, change > 0, done > 0,
                self.grads.result[3 + len(epochs) + len(reductions):])

    @property
    def step_epoch(self) -> int:
        """The epoch of the step whose gradients were last reduced: the highest epoch
        of any member's microbatches in it (the same on every member; -1 if unknown,
        e.g. batches a custom loop made itself)."""
        world = self.group.world_size
        slots = self.grads.result[3:3 + world]
        return int(max(slots)) - 1 if slots else -1

    @property
    def step_lr_reductions(self) -> int:
        """The metric-driven LR reductions of the step whose gradients were last
        reduced: the most any member's microbatches carried (the same on every member)."""
        world = self.group.world_size
        slots = self.grads.result[3 + world:3 + 2 * world]
        return int(max(slots)) if slots else 0

    def _confirm(self, version: int) -> None:
        self.confirmed_version = max(self.confirmed_version, version)
        done = [tags for v, tags in self._unconfirmed if v <= version]
        self._unconfirmed = [(v, t) for v, t in self._unconfirmed if v > version]
        if done and self.on_confirmed is not None:
            self.on_confirmed([t for tags in done for t in tags])

    def _reform(self) -> bool:
        """Form the next group and sync state; False when continuity was lost."""
        had_group = self.group.formations > 0
        while True:
            self.group.form()
            try:
                self._sync_state()
                break
            except CollectiveError as e:
                self.group.fail(str(e))
        continuous = not (had_group and self.group.rejoined)
        if continuous:
            self._confirm(self.state.model_version)
        else:
            lost = [t for _, tags in self._unconfirmed for t in tags]
            self._unconfirmed = []
            if self.trained is not None:  # the adopted model may hold them after all
                held = [t for t in lost if self.trained.holds(t)]
                lost = [t for t in lost if not self.trained.holds(t)]
                if held and self.on_confirmed is not None:
                    self.on_confirmed(held)
            logger.warning("re-joined the group: %d unconfirmed minibatch(es) will be "
                           "trained again", len(lost))
            if lost and self.on_lost is not None:
                self.on_lost(lost)
        self.confirmed_version = self.state.model_version
        return continuous

    def _sync_state(self) -> None:
        """Broadcast the state of the member with the highest model version, and a
        filler batch to members that have none."""
        world = self.group.world_size
        mine = torch.tensor([self.state.model_version, int(self._filler is not None)],
                            dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(world)]
        with guard("all_gather (model versions)"):
            dist.all_gather(rows, mine)
        versions = [int(r[0].item()) for r in rows]
        fillers = [bool(r[1].item()) for r in rows]
        src = versions.index(max(versions))
        self._need_fillers = not any(fillers)
        got = broadcast_state(self.state.state_dict(), src, self.device)
        if self.group.rank != src:
            self.state.load_state_dict(got)
        if any(fillers) and not all(fillers):
            box = [self._filler]
            with guard("broadcast (filler batch)"):
                dist.broadcast_object_list(box, src=fillers.index(True), device=self.device)
            if self._filler is None:
                self._filler = box[0]
        self.grads.abandon()
        logger.info("plan %d: state of rank %d (model version %d) broadcast to %d member(s); "
                    "versions were %s", self.group.version, src, max(versions), world, versions)

    def _exchange_fillers(self, micro: Sequence[Microbatch]) -> None:
        """Before a step in which a member may have neither data nor a filler batch:
        a member with data sends its first batch to those without one (a blocking
        collective, only until every member has a filler)."""
        has = bool(micro) or self._filler is not None
        mine = torch.tensor([int(has)], dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.group.world_size)]
        with guard("all_gather (filler flags)"):
            dist.all_gather(rows, mine)
        flags = [bool(r.item()) for r in rows]
        if not any(flags):
            return  # nobody has data: an idle round on every member
        self._need_fillers = False
        if all(flags):
            return
        src = flags.index(True)
        box = [(micro[0].args if micro else self._filler) if self.group.rank == src else None]
        with guard("broadcast (filler batch)"):
            dist.broadcast_object_list(box, src=src, device=self.device)
        if self._filler is None and not micro:
            self._filler = box[0]
            logger.info("no data yet: received a filler batch from rank %d", src)

    # ------------------------------------------------------ optimizer gating
    def _install_gate(self, opt: torch.optim.Optimizer) -> None:
        """During accumulation ``step()`` only acts on a step's last microbatch and
        ``zero_grad()`` only on its first; ``step()`` first completes the gradient
        reduction and is skipped when no member had data. Installed as bound
        methods, so LR schedulers (which wrap ``optimizer.step``) keep working."""
        runner = self
        orig_step, orig_zero = opt.step, opt.zero_grad
        self._orig_step = orig_step

        def step(self_: Any, *args: Any, **kwargs: Any) -> Any:
            phase = runner._phase
            if phase is not None and not phase[1]:
                return None
            result = runner.grads.finish()
            if phase is not None and result and result[0] <= 0:
                return None  # an idle round: nobody had data
            if runner.before_step is not None and not runner.before_step():
                if runner.after_step is not None:
                    runner.after_step(False)
                return None
            out = orig_step(*args, **kwargs)
            if runner.after_step is not None:
                runner.after_step(True)
            return out

        def zero_grad(self_: Any, *args: Any, **kwargs: Any) -> Any:
            phase = runner._phase
            if phase is not None and not phase[0]:
                return None
            runner.grads.grads_cleared()
            return orig_zero(*args, **kwargs)

        opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]
        opt.zero_grad = types.MethodType(zero_grad, opt)  # type: ignore[method-assign]
