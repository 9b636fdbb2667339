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

Every backward of a step is reduced (issue 10, item 6): after the first
reduction wrote the averaged gradient into ``.grad``, a further backward in the
same step (an auxiliary loss, ``retain_graph``) accumulates this member's new
local gradient on top; its hooks reduce ``.grad`` minus what the previous
reduction wrote, so the result is the average of every backward, identical on
all members. (An ``optimizer.zero_grad()`` in between makes the next backward
purely local again.)

Gradient accumulation (``--fixed_global_batch_size``, item 7): a parameter that
receives no gradient in the last microbatch keeps the gradient accumulated in
``.grad`` by the earlier ones; it is reduced at the end of backward.

Buffers (BatchNorm running statistics, item 8) are synchronised with every
reduction: floating buffers are averaged weighted by the members' records in
the step (a filler batch weighs 0, so it never moves them; for a running mean
this is exactly the running mean of the union batch), integer buffers
(``num_batches_tracked``) take the maximum. The buffer all-reduces are launched
by the first gradient hook of a backward (forward, which moves the buffers, is
done by then; on every member before any bucket, so collectives stay in the
same order) and overlap with backward.

Sparse tables (``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``) stay
out of the buckets: at the end of backward their coalesced rows, weighted by
records like the buckets, are all-gathered and summed
(:mod:`elasticdl.elastic.sparse_sync`) and ``.grad`` becomes the coalesced
sparse sum divided by ``N``; accumulation, further backward passes and filler
steps follow the dense rules (a sparse ``.grad`` accumulates by concatenation).

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

from elasticdl.common.collective import guard, wait
from elasticdl.elastic.sparse_sync import SparseRows, as_rows

logger = logging.getLogger(__name__)


@dataclass
class _Bucket:
    params: list[int]                  # indexes into GradientAllreducer.params
    offsets: list[int]
    flat: torch.Tensor
    ready: set[int] = field(default_factory=set)
    work: Optional[Any] = None
    prior: Optional[torch.Tensor] = None   # what earlier reductions of the step wrote


class GradientAllreducer:
    """Averages the gradients of ``params`` over a process group (see module docs).

    Args:
        params: the model's parameters; those not requiring grad are ignored.
        buffers: the model's buffers, synchronised with every reduction.
        bucket_cap_mb: size of every bucket but the first.
        first_bucket_mb: size of the first bucket.
        sparse: the parameters among ``params`` whose gradients are sparse rows
            (:func:`~elasticdl.elastic.sparse_sync.sparse_grad_params`); the same
            on every member.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 buffers: Iterable[torch.Tensor] = (), bucket_cap_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, sparse: Iterable[torch.nn.Parameter] = ()):
        self.params = [p for p in params if p.requires_grad]
        sparse_ids = {id(p) for p in sparse}
        self._sparse_index = [i for i, p in enumerate(self.params) if id(p) in sparse_ids]
        self._sparse_set = set(self._sparse_index)
        self._rows = SparseRows([self.params[i] for i in self._sparse_index])
        # per sparse table: the gathered sum of the last reduction, what earlier
        # reductions of the step wrote (like _Bucket.prior)
        self._sparse_sums: list[Optional[torch.Tensor]] = [None] * len(self._sparse_index)
        self._sparse_prior: list[Optional[torch.Tensor]] = [None] * len(self._sparse_index)
        self.buffers = [b for b in buffers if b is not None]
        self._buffer_work: list[tuple[list[torch.Tensor], torch.Tensor, bool, Any]] = []
        self._records = 0.0
        self._saved: Optional[list[torch.Tensor]] = None   # buffers before a filler step
        self._cleared = False  # zero_grad() since the last reduction of the step
        self._buckets = self._layout(bucket_cap_mb, first_bucket_mb)
        self._where: dict[int, tuple[int, int]] = {}
        for b, bucket in enumerate(self._buckets):
            for i, off in zip(bucket.params, bucket.offsets):
                self._where[i] = (b, off)
        self._group: Optional[dist.ProcessGroup] = None
        self._active = False   # a reduction is in flight (meta launched or a further backward)
        self._armed = False    # hooks reduce the backward passes of this step
        self._reductions = 0   # reductions completed in this step
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
            if i in self._sparse_set:
                continue
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
        self._reductions = 0
        self._cleared = False
        self._records = float(meta[0]) if meta else 0.0
        # a member without data: its filler forward must not move the buffers if no
        # member had data (an idle round), so they are restored then
        self._saved = [b.detach().clone() for b in self.buffers] if not self._records else None
        self._next = 0
        self._queued = False
        self.result = []
        self._buffer_work = []
        for bucket in self._buckets:
            bucket.ready.clear()
            bucket.work = None
            bucket.prior = None
        self._sparse_sums = [None] * len(self._sparse_index)
        self._sparse_prior = [None] * len(self._sparse_index)
        device = self.params[0].device if self.params else torch.device("cpu")
        self._meta = torch.tensor(meta, dtype=torch.float64, device=device)
        with guard("step meta all_reduce"):
            self._meta_work = dist.all_reduce(self._meta, group=group, async_op=True)

    def arm(self, scale: float) -> None:
        """Reduce the gradients of the following backward passes of this step,
        weighted by ``scale`` (this member's records; 0 contributes zeros)."""
        if not self._active:
            raise RuntimeError("arm() outside a step; call begin() first")
        self._scale = scale
        self._armed = True

    def end_step(self) -> None:
        """The step function returned: later backward passes are not reduced."""
        self._armed = False

    def grads_cleared(self) -> None:
        """``.grad`` was zeroed inside the step: the next backward is purely local."""
        self._cleared = True

    def _restart(self) -> None:
        """A further backward in a step whose gradients were already reduced."""
        total = self.result[0] if self.result else 0.0
        for bucket in self._buckets:
            if self._cleared or total <= 0:
                bucket.prior = None
            else:  # exactly what finish() wrote into .grad (same elementwise ops)
                written = torch.div(bucket.flat, total)
                if bucket.prior is not None:
                    written.add_(bucket.prior)
                bucket.prior = written
            bucket.ready.clear()
            bucket.work = None
        for k, summed in enumerate(self._sparse_sums):
            if self._cleared or total <= 0 or summed is None:
                self._sparse_prior[k] = None
            else:  # what finish() wrote into .grad
                prior = self._sparse_prior[k]
                written = summed / total
                self._sparse_prior[k] = (written + prior).coalesce() if prior is not None \
                    else written
        self._cleared = False
        self._next = 0
        self._queued = False
        self._active = True

    @property
    def active(self) -> bool:
        return self._active

    def abandon(self) -> list[Any]:
        """Forget a step in flight (after a failure; its group is destroyed).

        Returns the pending work objects: dropping the last reference to one
        may block until its collective times out, so the caller disposes of
        them (:func:`elasticdl.common.collective.dispose`)."""
        pending = [w for w in [self._meta_work] + [b.work for b in self._buckets] +
                   [bw[3] for bw in self._buffer_work] + self._rows.abandon()
                   if w is not None]
        self._sparse_sums = [None] * len(self._sparse_index)
        self._sparse_prior = [None] * len(self._sparse_index)
        self._active = self._armed = False
        self._meta_work = None
        self._buffer_work = []
        for bucket in self._buckets:
            bucket.work = None
            bucket.ready.clear()
            bucket.prior = None
        return pending

    # --------------------------------------------------------------- hooks
    def _hook(self, index: int) -> Any:
        def on_grad(param: torch.Tensor) -> None:
            if not self._armed:
                return
            if not self._active:
                self._restart()
            if not self._queued:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
                if self.buffers and not self._buffer_work:
                    self._launch_buffers()  # forward is done: overlap them with backward
            grad = param.grad
            if grad is None or index in self._sparse_set:
                return  # sparse tables: their rows are exchanged at the end of backward
            if grad.is_sparse:
                raise RuntimeError(
                    f"a sparse gradient for a parameter of shape {tuple(param.shape)} whose "
                    "module is not marked sparse=True: allreduce sends sparse rows only for "
                    "the weights of modules with sparse=True (nn.Embedding, nn.EmbeddingBag)")
            b, off = self._where[index]
            bucket = self._buckets[b]
            self._copy_in(bucket, off, param.numel(), grad)
            bucket.ready.add(index)
            self._launch_ready()
        return on_grad

    def _copy_in(self, bucket: _Bucket, off: int, numel: int, grad: torch.Tensor) -> None:
        dst = bucket.flat[off:off + numel]
        if self._scale == 0.0:
            dst.zero_()  # an idle member: zeros, even if its filler grads hold inf/nan
            return
        src = grad.reshape(-1)
        if bucket.prior is not None:  # a further backward: only what it added
            src = src - bucket.prior[off:off + numel]
        if self._scale == 1.0:
            dst.copy_(src)
        else:
            torch.mul(src, self._scale, out=dst)

    def _sparse_rows(self) -> list[Optional[torch.Tensor]]:
        """This member's contribution per sparse table: its ``.grad`` rows (minus what
        earlier reductions of the step wrote) times its records; None for none."""
        out: list[Optional[torch.Tensor]] = []
        for k, i in enumerate(self._sparse_index):
            grad = self.params[i].grad
            if not self._armed or grad is None or self._scale == 0.0:
                out.append(None)  # unarmed / idle: zeros, even if filler grads hold nan
                continue
            prior = self._sparse_prior[k]
            rows = as_rows(grad - prior if prior is not None else grad)
            out.append(rows if self._scale == 1.0 else rows * self._scale)
        return out

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

    def _launch_buffers(self) -> None:
        """All-reduce the buffers: floating ones weighted by records (SUM), integer
        ones by MAX; one flat tensor per (dtype, device)."""
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for buf in self.buffers:
            groups.setdefault((buf.dtype, buf.device), []).append(buf)
        for (dtype, _), bufs in groups.items():
            flat = torch.cat([b.detach().reshape(-1) for b in bufs])
            floating = dtype.is_floating_point or dtype.is_complex
            if floating:
                flat.mul_(self._records)
            op = dist.ReduceOp.SUM if floating else dist.ReduceOp.MAX
            with guard("buffer all_reduce"):
                work = dist.all_reduce(flat, op=op, group=self._group, async_op=True)
            self._buffer_work.append((bufs, flat, floating, work))

    def _write_buffers(self, total: float) -> None:
        if total <= 0 and self._saved is not None:
            with torch.no_grad():
                for buf, old in zip(self.buffers, self._saved):
                    buf.copy_(old)
        for bufs, flat, floating, _ in self._buffer_work:
            if total <= 0:
                continue
            if floating:
                flat.div_(total)
            with torch.no_grad():
                for buf, piece in zip(bufs, torch.split(flat, [b.numel() for b in bufs])):
                    buf.copy_(piece.view_as(buf))
        self._buffer_work = []

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
            if self.buffers and not self._buffer_work:
                self._launch_buffers()  # no backward ran: still before any bucket
            for bucket in self._buckets[self._next:]:
                for i, off in zip(bucket.params, bucket.offsets):
                    if i in bucket.ready:
                        continue
                    p = self.params[i]
                    if self._armed and p.grad is not None:
                        # no gradient in this backward: keep what earlier microbatches
                        # (or backward passes) accumulated in .grad
                        self._copy_in(bucket, off, p.numel(), p.grad)
                    else:
                        bucket.flat[off:off + p.numel()].zero_()
                self._launch(bucket)
            self._next = len(self._buckets)
            if self._sparse_index:  # after every bucket: the same order on every member
                self._sparse_sums = list(self._rows.reduce(self._sparse_rows(), self._group))
            if self._meta_work is not None:
                wait(self._meta_work, "step meta all_reduce")
                assert self._meta is not None
                self.result = [float(v) for v in self._meta.tolist()]
            for bucket in self._buckets:
                wait(bucket.work, "gradient all_reduce")
            for *_, work in self._buffer_work:
                wait(work, "buffer all_reduce")
        except BaseException:
            self._active = False  # pending work stays referenced until abandon()
            raise
        self._active = False
        self._meta_work = None
        total = self.result[0]
        self._write_buffers(total)
        for bucket in self._buckets:
            if total > 0:
                for i, off in zip(bucket.params, bucket.offsets):
                    p = self.params[i]
                    summed = bucket.flat[off:off + p.numel()].view_as(p)
                    if p.grad is None:
                        p.grad = summed / total
                    else:
                        torch.div(summed, total, out=p.grad)
                    if bucket.prior is not None:
                        p.grad.add_(bucket.prior[off:off + p.numel()].view_as(p))
            bucket.work = None
        if total > 0:
            for k, i in enumerate(self._sparse_index):
                rows = self._sparse_sums[k]
                assert rows is not None
                grad = rows / total
                prior = self._sparse_prior[k]
                self.params[i].grad = (grad + prior).coalesce() if prior is not None else grad
        self._reductions += 1
        self._cleared = False
        return self.result
