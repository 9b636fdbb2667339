"""Collectives on the current elastic group that keep autograd, and state broadcast.

Shared by the elastic runtime (:mod:`elasticdl.elastic`) and model authors
(``elasticdl.api.all_gather`` / ``all_reduce``), hence here, below both.

Every function here runs on ``group`` (default: the process group of the current
elastic plan, i.e. torch.distributed's default group) and turns a failure of the
underlying collective — a peer that died (``Connection reset by peer``), a
collective that timed out after ``--collective_timeout_s``, a store that is gone —
into :class:`CollectiveError`, which the elastic step wrapper
(:mod:`elasticdl.elastic.runner`) catches to re-rendezvous and retry. Errors of any
other kind pass through unchanged.

Bounded detection: :func:`wait` (the waits of the gradient buckets and the step
meta) blocks in slices of ``POLL_S`` and, between slices, asks the abort check
the elastic group installed (:func:`set_abort_check`: "has the master declared
this plan broken?"). The master learns of a dead process at once from the
cluster, so survivors abandon a collective on a dead or hung peer within about
a second instead of waiting for ``--collective_timeout_s``. Work abandoned that
way (and its process group) is handed to :func:`dispose`: destroying a gloo
group whose collective is still pending blocks until that collective times out,
so it happens on a background thread.

``all_gather`` and autograd
---------------------------
``torch.distributed.all_gather`` drops the gradient, and
``torch.distributed.nn.functional.all_gather`` is deprecated (and aborts on gloo in
torch 2.13), so :func:`all_gather` is our own ``autograd.Function``:

* default (``local_grad=False``): backward gives each rank the gradient of the
  **sum of every rank's loss** with respect to its own input (the incoming
  gradients of all ranks are summed, then each rank keeps its own slice: a
  reduce-scatter; on gloo, which has no reduce-scatter, an all-reduce). This is
  the right gradient whenever the per-rank losses are combined by summing or
  averaging across ranks — as data-parallel training does when it averages
  gradients — e.g. a contrastive loss over the global batch where each rank
  computes the loss of its own rows against all gathered rows.
* ``local_grad=True``: each rank only gets the gradient of *its own* loss with
  respect to its input (the gradient flowing into its own slot), the semantics
  of the widely copied SimCLR ``GatherLayer``. Use it when each rank's loss is
  optimised on its own, or when gradients are averaged afterwards by the data
  parallel machinery and you want exactly the per-rank term; combined with
  gradient averaging over ``world_size`` ranks it yields ``1/world_size`` of the
  default gradient.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

ProcessGroup = Optional[dist.ProcessGroup]


class CollectiveError(RuntimeError):
    """A collective (or the store behind a group) failed or timed out.

    The group is unusable afterwards; the elastic layer destroys it, reports to
    the master and forms a new one. ``op`` names the collective.
    """

    def __init__(self, op: str, cause: BaseException):
        super().__init__(f"{op} failed: {type(cause).__name__}: {cause}")
        self.op = op


@contextmanager
def guard(op: str) -> Iterator[None]:
    """Turn failures of the torch.distributed call inside into :class:`CollectiveError`.

    torch raises ``RuntimeError`` (``DistBackendError``, ``DistNetworkError``,
    ``DistStoreError`` are subclasses) for connection resets and timeouts; only
    torch.distributed calls may run inside, so no user error is relabelled.
    """
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        raise CollectiveError(op, e) from e


POLL_S = 0.25
_abort_check: Optional[Callable[[], bool]] = None


def set_abort_check(check: Optional[Callable[[], bool]]) -> None:
    """Install (None: remove) the check :func:`wait` calls while a collective is slow."""
    global _abort_check
    _abort_check = check


class PlanAborted(RuntimeError):
    """The master declared the current plan broken while we waited."""


def wait(work: Any, op: str) -> None:
    """``work.wait()`` with failures as :class:`CollectiveError`; with an abort
    check installed, gives up (CollectiveError) as soon as it says so."""
    check = _abort_check
    if check is None:
        with guard(op):
            work.wait()
        return
    step = datetime.timedelta(seconds=POLL_S)
    while True:
        started = time.monotonic()
        try:
            work.wait(step)
            return
        except RuntimeError:
            if work.is_completed():  # finished as the slice ran out: its own outcome
                with guard(op):
                    work.wait()
                return
        overran = time.monotonic() - started - POLL_S
        if overran > 1.0:
            logger.info("%s: a %.2f s wait slice took %.2f s longer", op, POLL_S, overran)
        started = time.monotonic()
        aborted = check()
        if time.monotonic() - started > 1.0:
            logger.info("%s: asking the master about the plan took %.2f s", op,
                        time.monotonic() - started)
        if aborted:
            raise CollectiveError(op, PlanAborted("the master declared the plan broken (a "
                                                  "member died, hung or failed)"))


_abandoned: list[Any] = []


def defer_dispose(objs: list[Any]) -> None:
    """Keep abandoned work alive until its process group is destroyed: a gloo work
    destructor may block holding the group's locks, which would stall the destroy
    (measured: 9.8 s with a 10 s timeout); :func:`dispose` drops them after it."""
    _abandoned.extend(objs)


def dispose(objs: list[Any]) -> None:
    """Drop the last references to abandoned work/process groups (and those kept by
    :func:`defer_dispose`) on a daemon thread: their destructors may block until
    the pending collective times out. Call it after ``destroy_process_group``."""
    box = _abandoned + list(objs)
    _abandoned.clear()
    objs.clear()
    if not box:
        return

    def drop() -> None:
        # hold every reference until the pending collectives have ended (failed at
        # their timeout): whoever drops the last reference to an unfinished work runs
        # its blocking destructor, and other references (an exception's frames, the
        # garbage collector) may otherwise be released on the training thread
        deadline = time.monotonic() + 3600.0
        for obj in box:
            done = getattr(obj, "is_completed", None)
            while done is not None and time.monotonic() < deadline:
                try:
                    if done():
                        break
                except RuntimeError:
                    break
                time.sleep(0.5)
        box.clear()

    threading.Thread(target=drop, name="dispose-collectives", daemon=True).start()


def _backend(group: ProcessGroup) -> str:
    return str(dist.get_backend(group))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup,  # type: ignore[override]
                local_grad: bool) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.local_grad = local_grad
        ctx.rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(world)]
        with guard("all_gather"):
            dist.all_gather(out, tensor, group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        if ctx.local_grad:
            return grads[ctx.rank].contiguous(), None, None
        stacked = torch.stack([g.contiguous() for g in grads])
        if _backend(ctx.group) == "nccl":
            mine = torch.empty_like(grads[ctx.rank])
            with guard("all_gather backward (reduce_scatter)"):
                dist.reduce_scatter_tensor(mine, stacked, group=ctx.group)
            return mine, None, None
        with guard("all_gather backward (all_reduce)"):
            dist.all_reduce(stacked, group=ctx.group)
        return stacked[ctx.rank], None, None


def all_gather(tensor: torch.Tensor, local_grad: bool = False,
               group: ProcessGroup = None) -> list[torch.Tensor]:
    """Gather ``tensor`` from every rank, keeping autograd; see the module docs.

    Returns ``world_size`` tensors in rank order; this rank's own slot is a
    copy of ``tensor`` that gradients flow back through like the others.
    All ranks must pass tensors of the same shape and dtype.

    Raises:
        CollectiveError: the collective failed or timed out (forward or backward).
    """
    if not dist.is_initialized():
        return [tensor]
    return list(_AllGather.apply(tensor, group, local_grad))


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup,  # type: ignore[override]
                mean: bool) -> torch.Tensor:
        ctx.group = group
        ctx.mean = mean
        out = tensor.clone()
        with guard("all_reduce"):
            dist.all_reduce(out, group=group)
        if mean:
            out.div_(dist.get_world_size(group))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # d(sum over ranks of every rank's loss)/d(my input): the sum of all ranks' grads
        out = grad.contiguous().clone()
        with guard("all_reduce backward"):
            dist.all_reduce(out, group=ctx.group)
        if ctx.mean:
            out.div_(dist.get_world_size(ctx.group))
        return out, None, None


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: ProcessGroup = None) -> torch.Tensor:
    """Sum (``op="sum"``) or average (``op="mean"``) ``tensor`` over the ranks, with autograd.

    Returns a new tensor; the input is untouched. Backward gives each rank the
    gradient of the sum of every rank's loss, like :func:`all_gather`'s default.
    Without an initialised group (one process) it returns a copy.

    Raises:
        CollectiveError: the collective failed or timed out.
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    if not dist.is_initialized():
        return tensor.clone()
    return _AllReduce.apply(tensor, group, op == "mean")


# ----------------------------------------------------------------- state broadcast
@dataclass(frozen=True)
class _TensorSlot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype, obj.device.type == "cpu")
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def broadcast_state(state: Any, src: int, device: torch.device,
                    group: ProcessGroup = None) -> Any:
    """Send a nested structure of tensors and plain values from rank ``src`` to all.

    The structure (with tensors replaced by shape/dtype slots) travels pickled
    by ``broadcast_object_list``; tensors travel as one flat buffer per dtype on
    ``device`` (on CUDA nothing goes through the host). Receivers get tensors on
    the device each had on ``src`` (CPU tensors such as an optimizer's ``step``
    stay on the CPU). ``state`` is ignored on receivers; ``src`` gets its own
    ``state`` back.

    Raises:
        CollectiveError: a collective failed or timed out.
    """
    rank = dist.get_rank(group)
    tensors: list[torch.Tensor] = []
    skeleton = [_strip(state, tensors) if rank == src else None]
    with guard("broadcast (state structure)"):
        dist.broadcast_object_list(skeleton, src=src, group=group, device=device)
    if rank == src:
        slots = [_TensorSlot(i, tuple(t.shape), t.dtype, t.device.type == "cpu")
                 for i, t in enumerate(tensors)]
    else:
        slots = []
        _collect_slots(skeleton[0], slots)
        slots.sort(key=lambda s: s.index)
    out: list[torch.Tensor] = [torch.empty(0)] * len(slots)
    by_dtype: dict[torch.dtype, list[_TensorSlot]] = {}
    for slot in slots:
        by_dtype.setdefault(slot.dtype, []).append(slot)
    for dtype, group_slots in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        numels = [int(torch.Size(s.shape).numel()) for s in group_slots]
        if rank == src:
            flat = torch.cat([tensors[s.index].reshape(-1).to(device) for s in group_slots])
        else:
            flat = torch.empty(sum(numels), dtype=dtype, device=device)
        with guard("broadcast (state tensors)"):
            dist.broadcast(flat, src=src, group=group)
        if rank == src:
            continue
        for slot, piece in zip(group_slots, torch.split(flat, numels)):
            t = piece.view(slot.shape)
            out[slot.index] = t.cpu() if slot.on_cpu else t
    if rank == src:
        return state
    return _fill(skeleton[0], out)


def _collect_slots(obj: Any, slots: list[_TensorSlot]) -> None:
    if isinstance(obj, _TensorSlot):
        slots.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_slots(v, slots)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_slots(v, slots)
