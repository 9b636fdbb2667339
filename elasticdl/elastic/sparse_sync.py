"""Sparse (row) gradients in allreduce: tables synchronised as rows.

``nn.Embedding(..., sparse=True)`` and ``nn.EmbeddingBag(..., sparse=True)``
give their weight a sparse COO gradient: the rows the minibatch touched (ids,
and one value row per id). Summing such gradients densely would ship the whole
table every step; torch DDP reduces them with gloo's sparse all-reduce (an
all-gather of every member's rows). Here each member all-gathers its
*coalesced* rows of every sparse table — the row counts first (one small
all-gather), then every table's ids in one padded int64 all-gather and their
values in one padded all-gather per dtype — and every member builds the same
coalesced sum from the gathered pieces, in rank order, so the members' results
are bitwise identical. :class:`~elasticdl.elastic.grad_sync.GradientAllreducer`
weights each member's rows by its records and divides the sum by the step's
records, exactly as for dense buckets, which gives the update of DDP on the same
global batch (equal batches) and of one process on the union batch (any
batches). The optimizer steps with the result: a coalesced sparse gradient
(``SGD``, ``SparseAdam``, ``Adagrad`` take them).

Bytes on the wire per step are ``world × max-member-rows × row size`` (the
padding to the largest member), independent of the table's size.

A parameter is treated as a sparse table when its module has ``sparse=True``
(:func:`sparse_grad_params`); its gradient may also be dense (a weight shared
with a dense use), which is then sent as rows too (every row).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from elasticdl.common.collective import guard, wait

__all__ = ["SparseRows", "sparse_grad_params", "as_rows"]


def sparse_grad_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradients are sparse: the ``weight`` of every module
    with ``sparse=True`` (``nn.Embedding``, ``nn.EmbeddingBag``,
    ``elasticdl.api.layers.Embedding``) that requires a gradient, once each, in
    module order (the same on every member)."""
    out: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        if getattr(module, "sparse", False) is not True:
            continue
        weight = module._parameters.get("weight")
        if isinstance(weight, nn.Parameter) and weight.requires_grad and \
                id(weight) not in seen:
            seen.add(id(weight))
            out.append(weight)
    return out


def as_rows(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as a coalesced sparse tensor with one sparse dimension (rows)."""
    if not grad.is_sparse:
        return grad.to_sparse(1)
    if grad.sparse_dim() != 1:
        grad = grad.to_dense().to_sparse(1)
    return grad.coalesce()


class SparseRows:
    """All-gathers the row gradients of a fixed list of tables (same order on
    every member) and returns their sums (see the module docs).

    Args:
        params: the sparse tables' parameters (:func:`sparse_grad_params`).
    """

    def __init__(self, params: Sequence[nn.Parameter]):
        self.params = list(params)
        self._pending: list[object] = []

    def abandon(self) -> list[object]:
        """The work objects of an exchange interrupted by a failure."""
        pending, self._pending = self._pending, []
        return pending

    def _empty(self, p: nn.Parameter) -> torch.Tensor:
        return torch.sparse_coo_tensor(
            torch.zeros(1, 0, dtype=torch.int64, device=p.device),
            torch.zeros((0, *p.shape[1:]), dtype=p.dtype, device=p.device), p.shape,
            check_invariants=False)

    def reduce(self, rows: Sequence[Optional[torch.Tensor]],
               group: Optional[dist.ProcessGroup] = None) -> list[torch.Tensor]:
        """Sum every member's ``rows`` (one coalesced sparse tensor or None per
        table, this member's contribution) over ``group``; returns one coalesced
        sparse tensor per table, identical on every member.

        Raises:
            CollectiveError: a collective failed or timed out.
        """
        mine = [as_rows(r) if r is not None else self._empty(p)
                for r, p in zip(rows, self.params)]
        if not self.params:
            return []
        device = self.params[0].device
        world = dist.get_world_size(group)
        counts = torch.tensor([r._nnz() for r in mine], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(counts) for _ in range(world)]
        with guard("all_gather (sparse row counts)"):
            work = dist.all_gather(gathered, counts, group=group, async_op=True)
        self._pending = [work]
        wait(work, "all_gather (sparse row counts)")
        table_counts = torch.stack(gathered).tolist()   # [world][table]
        row_sizes = [int(torch.Size(p.shape[1:]).numel()) for p in self.params]

        # ids: one int64 all-gather, padded to the member with the most rows
        id_lens = [sum(c) for c in table_counts]
        ids = torch.zeros(max(1, max(id_lens)), dtype=torch.int64, device=device)
        own = id_lens[dist.get_rank(group)]
        if own:
            ids[:own] = torch.cat([r._indices()[0] for r in mine])
        id_bufs = [torch.empty_like(ids) for _ in range(world)]
        with guard("all_gather (sparse row ids)"):
            id_work = dist.all_gather(id_bufs, ids, group=group, async_op=True)
        # values: one all-gather per dtype, tables of that dtype in table order
        dtypes = sorted({p.dtype for p in self.params}, key=str)
        value_works = []
        for dtype in dtypes:
            tabs = [t for t, p in enumerate(self.params) if p.dtype == dtype]
            lens = [sum(c[t] * row_sizes[t] for t in tabs) for c in table_counts]
            vals = torch.zeros(max(1, max(lens)), dtype=dtype, device=device)
            own = lens[dist.get_rank(group)]
            if own:
                vals[:own] = torch.cat([mine[t]._values().reshape(-1) for t in tabs])
            bufs = [torch.empty_like(vals) for _ in range(world)]
            with guard("all_gather (sparse row values)"):
                value_works.append((tabs, bufs, dist.all_gather(bufs, vals, group=group,
                                                                async_op=True)))
        self._pending = [id_work] + [w for *_, w in value_works]
        wait(id_work, "all_gather (sparse row ids)")
        for *_, w in value_works:
            wait(w, "all_gather (sparse row values)")
        self._pending = []

        pieces_ids: list[list[torch.Tensor]] = [[] for _ in self.params]
        pieces_vals: list[list[torch.Tensor]] = [[] for _ in self.params]
        for r in range(world):
            off = 0
            for t in range(len(self.params)):
                n = table_counts[r][t]
                pieces_ids[t].append(id_bufs[r][off:off + n])
                off += n
        for tabs, bufs, _ in value_works:
            for r in range(world):
                off = 0
                for t in tabs:
                    n = table_counts[r][t] * row_sizes[t]
                    pieces_vals[t].append(
                        bufs[r][off:off + n].view(table_counts[r][t], *self.params[t].shape[1:]))
                    off += n
        out = []
        for t, p in enumerate(self.params):
            idx = torch.cat(pieces_ids[t]).unsqueeze(0)
            val = torch.cat(pieces_vals[t])
            out.append(torch.sparse_coo_tensor(idx, val, p.shape,
                                               check_invariants=False).coalesce())
        return out
