"""Bucketed gradient all-reduce started from backward hooks.

:class:`GradientAllreducer` registers one ``post_accumulate_grad`` hook per
parameter. A step starts with :meth:`~GradientAllreducer.begin`, which launches
an asynchronous all-reduce of a few *meta* numbers (the member's record count
and control flags); it completes while forward and backward run, so it adds no
waiting point to the step. When the reducer is *armed* for a backward pass, each
hook copies its parameter's gradient — multiplied by this member's record count
— into a flat bucket buffer; as soon as a bucket is complete (and every bucket
before it has been launched, so all ranks issue collectives in the same order)
an asynchronous ``all_reduce`` (SUM) starts while backward goes on computing
the next gradients. At the end of backward (an autograd engine callback) the
buckets not launched yet are launched with zeros for gradients that never came
(parameters unused on this rank), every bucket is waited for, and the sums
divided by the step's total record count ``N`` (the first meta sum) are written
back into ``param.grad``.

Weighting by records instead of dividing by the world size makes the result the
gradient of the mean loss over the union of all members' records — exactly
single-process training on the union batch, also when members hold different
numbers of records (a short last minibatch, an idle member contributing zeros).

Buckets are laid out in reverse parameter order (roughly the order gradients
become ready in backward), the first one small (1 MiB) so communication starts
early, the others ``bucket_cap_mb`` — the layout torch DDP uses. On CUDA the
buckets live on the device: nothing is copied to the host.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from elasticdl.api.collective import guard, wait

logger = logging.getLogger(__name__)


@dataclass
class _Bucket:
    params: list[int]                  # indexes into GradientAllreducer.params
    offsets: list[int]
    flat: torch.Tensor
    ready: set[int] = field(default_factory=set)
    work: Optional[Any] = None


class GradientAllreducer:
    """Averages the gradients of ``params`` over a process group (see module docs).

    Args:
        params: the model's parameters; those not requiring grad are ignored.
        bucket_cap_mb: size of every bucket but the first.
        first_bucket_mb: size of the first bucket.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], bucket_cap_mb: float = 25.0,
                 first_bucket_mb: float = 1.0):
        self.params = [p for p in params if p.requires_grad]
        self._buckets = self._layout(bucket_cap_mb, first_bucket_mb)
        self._where: dict[int, tuple[int, int]] = {}
        for b, bucket in enumerate(self._buckets):
            for i, off in zip(bucket.params, bucket.offsets):
                self._where[i] = (b, off)
        self._group: Optional[dist.ProcessGroup] = None
        self._active = False   # a step is in progress (meta launched)
        self._armed = False    # hooks reduce this backward pass
        self._scale = 1.0
        self._meta: Optional[torch.Tensor] = None
        self._meta_work: Optional[Any] = None
        self.result: list[float] = []
        self._next = 0
        self._queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                         for i, p in enumerate(self.params)]

    def _layout(self, cap_mb: float, first_mb: float) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        current: list[int] = []
        size = 0
        cap = first_mb * 2**20

        def close() -> None:
            nonlocal current, size, cap
            if current:
                ref = self.params[current[0]]
                offsets, off = [], 0
                for i in current:
                    offsets.append(off)
                    off += self.params[i].numel()
                flat = torch.zeros(off, dtype=ref.dtype, device=ref.device)
                buckets.append(_Bucket(current, offsets, flat))
            current, size, cap = [], 0, cap_mb * 2**20

        for i in reversed(range(len(self.params))):
            p = self.params[i]
            if current:
                ref = self.params[current[0]]
                if p.dtype != ref.dtype or p.device != ref.device:
                    close()
            current.append(i)
            size += p.numel() * p.element_size()
            if size >= cap:
                close()
        close()
        return buckets

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    # ------------------------------------------------------------- control
    def begin(self, meta: list[float], group: Optional[dist.ProcessGroup] = None) -> None:
        """Start a step: launch the all-reduce of ``meta`` (``meta[0]``: this
        member's records in the step). Every member calls it once per step.

        Raises:
            CollectiveError: the collective could not be launched.
        """
        self._group = group
        self._active = True
        self._armed = False
        self._next = 0
        self._queued = False
        self.result = []
        for bucket in self._buckets:
            bucket.ready.clear()
            bucket.work = None
        device = self.params[0].device if self.params else torch.device("cpu")
        self._meta = torch.tensor(meta, dtype=torch.float64, device=device)
        with guard("step meta all_reduce"):
            self._meta_work = dist.all_reduce(self._meta, group=group, async_op=True)

    def arm(self, scale: float) -> None:
        """Reduce the gradients of the next backward pass, weighted by ``scale``
        (this member's records; 0 contributes zeros)."""
        if not self._active:
            raise RuntimeError("arm() outside a step; call begin() first")
        self._scale = scale
        self._armed = True

    @property
    def active(self) -> bool:
        return self._active

    def abandon(self) -> None:
        """Forget a step in flight (after a failure; its group is destroyed)."""
        self._active = self._armed = False
        self._meta_work = None
        for bucket in self._buckets:
            bucket.work = None
            bucket.ready.clear()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # --------------------------------------------------------------- hooks
    def _hook(self, index: int) -> Any:
        def on_grad(param: torch.Tensor) -> None:
            if not (self._armed and self._active):
                return
            if not self._queued:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            grad = param.grad
            if grad is None:
                return
            if grad.is_sparse:
                raise RuntimeError("sparse gradients are not supported by allreduce")
            b, off = self._where[index]
            bucket = self._buckets[b]
            self._copy_in(bucket.flat[off:off + param.numel()], grad)
            bucket.ready.add(index)
            self._launch_ready()
        return on_grad

    def _copy_in(self, dst: torch.Tensor, grad: torch.Tensor) -> None:
        if self._scale == 0.0:
            dst.zero_()  # an idle member: zeros, even if its filler grads hold inf/nan
        elif self._scale == 1.0:
            dst.copy_(grad.reshape(-1))
        else:
            torch.mul(grad.reshape(-1), self._scale, out=dst)

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets):
            bucket = self._buckets[self._next]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        with guard("gradient all_reduce"):
            bucket.work = dist.all_reduce(bucket.flat, group=self._group, async_op=True)

    def _on_backward_end(self) -> None:
        self.finish()

    def finish(self) -> list[float]:
        """Launch what is left, wait for the meta and every bucket, write the
        gradient sums divided by ``N`` into ``.grad``; returns the meta sums.

        Runs by itself at the end of an armed backward pass; call it directly
        when no backward ran (contributing zeros). A no-op returning the last
        result when no step is active. With ``N == 0`` (nobody had data) the
        gradients are left alone.

        Raises:
            CollectiveError: an all-reduce failed or timed out.
        """
        if not self._active:
            return self.result
        try:
            for bucket in self._buckets[self._next:]:
                for i, off in zip(bucket.params, bucket.offsets):
                    if i not in bucket.ready:
                        bucket.flat[off:off + self.params[i].numel()].zero_()
                self._launch(bucket)
            self._next = len(self._buckets)
            wait(self._meta_work, "step meta all_reduce")
            for bucket in self._buckets:
                wait(bucket.work, "gradient all_reduce")
        finally:
            self._active = self._armed = False
        assert self._meta is not None
        self.result = [float(v) for v in self._meta.tolist()]
        total = self.result[0]
        for bucket in self._buckets:
            if total > 0:
                for i, off in zip(bucket.params, bucket.offsets):
                    p = self.params[i]
                    summed = bucket.flat[off:off + p.numel()].view_as(p)
                    if p.grad is None:
                        p.grad = summed / total
                    else:
                        torch.div(summed, total, out=p.grad)
            bucket.work = None
        self._meta_work = None
        return self.result
