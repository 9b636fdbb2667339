"""A consistent copy of a table's rows at one moment, taken without stopping training.

At the cut (under the shard lock, O(1) per table for a full snapshot, one pass over the
dirty bitmap for a delta) a :class:`TableSnapshot` fixes *which* rows it holds: every row
present (``slots=None``: rows ``[0, size)``) or the rows changed since the previous
checkpoint (the dirty slots). It copies them afterwards, ``CHUNK_ROWS`` at a time, each
chunk under the shard lock (a few milliseconds), while training goes on between chunks.

Copy-on-write keeps the copy at the cut: before the row optimizer changes rows, the shard
calls :meth:`TableSnapshot.preserve` with their slots (under the lock, as every update);
the rows the copy has not reached yet are copied *first*, as they are before the update,
and the chunk copy skips them later. So each row's weights and every optimizer slot come
from the cut, together with the ledger, the dense parameters and the version the shard
captured at the same moment. A writer pays once per row it touches before the copy got
there; a row is never copied twice.

Slots are stable: a row keeps its slot until it is evicted (its slot then holds id -1, a
tombstone, until a new row reuses it; both changes mark the slot dirty), so a full
snapshot lists slots in order (evicted ones with id -1, which readers drop), a delta names
its rows' slots, and a restore merges a delta onto the full by slot (checked against the
ids: a slot changes id only through a tombstone or an eviction the delta records).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np
import torch

from elasticdl.ps import row_arena

CHUNK_ROWS = 1 << 15   # 32,768 rows (4.5 MB of weights + Adagrad state at dim 16)


@dataclass
class CheckpointChain:
    """The checkpoints one PS wrote since its state began (a restore starts a new chain):
    a delta is taken against ``last_version`` and is restored onto ``full_version``."""

    last_version: Optional[int] = None   # the newest checkpoint cut (None: write whole)
    full_version: Optional[int] = None   # the whole one the chain starts from
    since_full: int = 0                  # checkpoints cut since (and with) that one


class RowTable(Protocol):
    """What a snapshot reads of a table (:class:`~elasticdl.ps.parameters.EmbeddingTable`)."""

    weights: torch.Tensor
    row_ids: np.ndarray
    state: dict[str, torch.Tensor]
    size: int
    snapshot: Optional[TableSnapshot]
    touched: Optional[np.ndarray]   # last-update versions (uint32; tables that evict)


class TableSnapshot:
    """The rows of one table at the cut (see the module doc); built under the lock."""

    def __init__(self, table: RowTable, slots: Optional[np.ndarray]):
        self.table = table
        self.size = table.size          # rows the table had at the cut
        self.slots = slots              # None: all rows [0, size); else sorted slots
        n = self.size if slots is None else int(slots.shape[0])
        self.rows = n
        dim = table.weights.shape[1]
        # mapped, not touched (the copy fills them), unmapped once written and dropped
        self._ids = row_arena.buffer(n, (), torch.int64)
        self.ids = self._ids.numpy()
        self.weights = row_arena.buffer(n, (dim,), table.weights.dtype)
        self.state = {k: row_arena.buffer(n, tuple(v.shape[1:]), v.dtype)
                      for k, v in table.state.items()}
        # the rows' last-update versions (uint32, kept as int32 bits: the TTL and LRU
        # clocks go on after a restore); None for a table that does not evict
        self.clocks = None if table.touched is None else row_arena.buffer(n, (), torch.int32)
        self._clocks = None if self.clocks is None else self.clocks.numpy().view(np.uint32)
        self.saved = np.zeros(n, dtype=bool)   # copied ahead of the chunk copy by a writer
        # ids evicted since the previous cut (None: too many to record)
        self.evicted: Optional[np.ndarray] = np.zeros(0, dtype=np.int64)
        self.partial = False   # the table admits or evicts: rows may be missing
        self.pos = 0                           # positions [0, pos) are copied

    @property
    def done(self) -> bool:
        return self.pos >= self.rows

    def _positions(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, slots)`` of ``slots`` that are in the snapshot and not copied."""
        if self.slots is None:
            keep = (slots >= self.pos) & (slots < self.size)
            return slots[keep], slots[keep]
        if self.rows == 0:
            return slots[:0], slots[:0]
        pos = np.searchsorted(self.slots, slots)
        np.minimum(pos, self.rows - 1, out=pos)
        keep = (self.slots[pos] == slots) & (pos >= self.pos)
        return pos[keep], slots[keep]

    def preserve(self, slots: np.ndarray) -> int:
        """Copy the rows ``slots`` (about to change) if the snapshot still needs them as
        they are; returns how many were copied (lock held)."""
        if self.done:
            return 0
        positions, src = self._positions(slots)
        fresh = ~self.saved[positions]
        positions, src = positions[fresh], src[fresh]
        if positions.shape[0] == 0:
            return 0
        self._copy(positions, src)
        self.saved[positions] = True
        return int(positions.shape[0])

    def _copy(self, positions: np.ndarray, src: np.ndarray) -> None:
        t = self.table
        dst_t, src_t = torch.from_numpy(positions), torch.from_numpy(src)
        self.ids[positions] = t.row_ids[src]
        if self._clocks is not None and t.touched is not None:
            self._clocks[positions] = t.touched[src]
        self.weights.index_copy_(0, dst_t, t.weights.index_select(0, src_t))
        for k, out in self.state.items():
            out.index_copy_(0, dst_t, t.state[k].index_select(0, src_t))

    def copy_chunk(self, rows: Optional[int] = None) -> None:
        """Copy the next ``rows`` positions (default ``CHUNK_ROWS``; lock held), skipping
        those a writer saved."""
        lo = self.pos
        hi = min(lo + (CHUNK_ROWS if rows is None else rows), self.rows)
        if lo >= hi:
            return
        saved = self.saved[lo:hi]
        t = self.table
        if self.slots is None and not saved.any():   # the usual case: one block
            self.ids[lo:hi] = t.row_ids[lo:hi]
            if self._clocks is not None and t.touched is not None:
                self._clocks[lo:hi] = t.touched[lo:hi]
            self.weights[lo:hi] = t.weights[lo:hi]
            for k, out in self.state.items():
                out[lo:hi] = t.state[k][lo:hi]
        else:
            positions = np.arange(lo, hi, dtype=np.int64)[~saved]
            src = positions if self.slots is None else self.slots[positions]
            self._copy(positions, src)
        self.pos = hi

    def release(self) -> None:
        """Hand the copy's memory back (written, or abandoned): a step at a time
        (:func:`row_arena.release`), not one unmap that stalls the PS's threads."""
        row_arena.release(self._ids, self.weights, *self.state.values(),
                          *([] if self.clocks is None else [self.clocks]))

    def finish(self) -> None:
        """Copy everything left (lock held): a new cut cannot start before the last one's
        copy is complete."""
        while not self.done:
            self.copy_chunk(1 << 30)
