"""Admission and eviction on an embedding table's rows (the methods of
:class:`~elasticdl.ps.parameters.EmbeddingTable` that count ids without a row, evict rows
by TTL or capacity and record the evicted ids for the next checkpoint; the policy and its
victim choice are :mod:`elasticdl.ps.eviction`)."""

from __future__ import annotations

from typing import Optional, Protocol

import numpy as np
import torch

from elasticdl.common.tables import TableSpec
from elasticdl.ps.admission import CountingSketch
from elasticdl.ps.eviction import TablePolicy, VersionClock, lru_victims, ttl_victims
from elasticdl.ps.slot_index import SlotIndex


class TableLike(Protocol):
    """What these methods read and call of their table."""

    spec: TableSpec
    ps_id: int
    num_ps: int
    policy: TablePolicy
    now: int
    size: int
    stats: dict[str, int]
    sketch: Optional[CountingSketch]
    row_ids: np.ndarray
    touched: Optional[np.ndarray]
    clock: Optional[VersionClock]
    EVICTED_LOG_MAX: int
    _index: SlotIndex
    _free: np.ndarray
    _nfree: int
    _evicted: list[np.ndarray]
    _evicted_n: int
    _evicted_lost: bool
    _record_evicted: bool
    _sweep_pos: int
    _rng: np.random.Generator

    @property
    def live_rows(self) -> int: ...

    def check_ids(self, ids: np.ndarray, what: str = "") -> None: ...

    def slots(self, ids: np.ndarray, create: bool = True) -> torch.Tensor: ...

    def default_rows(self, ids: np.ndarray) -> torch.Tensor: ...

    def before_update(self, slots: torch.Tensor) -> None: ...

    def evict(self, slots: np.ndarray, reason: str = "ttl") -> int: ...

    def _add_rows(self, ids: np.ndarray, values: torch.Tensor, state: Optional[dict] = None,
                  keep: Optional[np.ndarray] = None, bounded: bool = True) -> None: ...


class RowPolicy:
    """Admission and eviction of a table's rows (a base of ``EmbeddingTable``)."""

    EVICTED_LOG_MAX = 1 << 22   # evicted ids kept for the next checkpoint's record

    @property
    def live_rows(self: TableLike) -> int:
        """Rows present (``size`` less the evicted slots not reused yet)."""
        return self.size - self._nfree

    def _admit(self: TableLike, ids: np.ndarray, keep: np.ndarray) -> None:
        """Count a training pull of ``ids`` without a row (unique); create the rows of
        those seen ``admit_after`` times now (lock held; ``keep``: the pull's rows)."""
        assert self.sketch is not None
        counts = self.sketch.add(ids)
        admitted = ids[counts >= self.policy.admit_after]
        if admitted.shape[0]:
            self._add_rows(admitted, self.default_rows(admitted), keep=keep)
            self.stats["admitted"] += int(admitted.shape[0])

    def slots_for_update(self: TableLike, ids: np.ndarray
                         ) -> tuple[Optional[np.ndarray], torch.Tensor]:
        """``(keep, slots)`` of the rows a gradient of ``ids`` updates: every id (rows
        created when missing, ``keep`` None) or, for a table that admits, only the ids
        with a row (``keep`` masks them; the others' gradients are dropped)."""
        if self.sketch is None:
            return None, self.slots(ids)
        self.check_ids(ids)
        found = self._index.find(ids // self.num_ps)
        keep = found >= 0
        self.stats["grads_dropped"] += int(keep.shape[0] - keep.sum())
        return keep, torch.from_numpy(found[keep])

    def set_now(self: TableLike, version: int) -> None:
        """The model version rows updated from now on are stamped with."""
        self.now = int(version)
        if self.clock is not None:
            self.clock.mark(self.now)

    def touch(self: TableLike, slots: torch.Tensor) -> None:
        """Rows ``slots`` were updated at this model version (their TTL and LRU age)."""
        if self.touched is not None:
            self.touched[slots.numpy()] = self.now

    def evict(self: TableLike, slots: np.ndarray, reason: str = "ttl") -> int:
        """Drop the rows in ``slots`` (present ones; lock held): their ids are forgotten,
        their slots reused, the ids recorded for the next checkpoint."""
        slots = np.unique(slots)
        slots = slots[self.row_ids[slots] >= 0]
        n = int(slots.shape[0])
        if n == 0:
            return 0
        self.before_update(torch.from_numpy(slots))   # the delta's tombstone; a snapshot
        ids = self.row_ids[slots].copy()               # being copied keeps the row
        self._index.remove(ids // self.num_ps)
        self.row_ids[slots] = -1
        if self._nfree + n > self._free.shape[0]:
            free = np.zeros(max(2 * self._free.shape[0], self._nfree + n), dtype=np.int64)
            free[:self._nfree] = self._free[:self._nfree]
            self._free = free
        self._free[self._nfree:self._nfree + n] = slots
        self._nfree += n
        if not self._record_evicted:
            pass   # no checkpoint yet: the first one is whole and needs no record
        elif self._evicted_n + n <= self.EVICTED_LOG_MAX:
            self._evicted.append(ids)
            self._evicted_n += n
        else:   # no checkpoint for long: the record stops (the tombstones suffice)
            self._evicted.clear()
            self._evicted_n, self._evicted_lost = 0, True
        self.stats["evicted_" + reason] += n
        return n

    def _make_room(self: TableLike, n: int, keep: Optional[np.ndarray]) -> None:
        """Evict the least recently updated rows (not in ``keep``) so that ``n`` more
        fit the bound."""
        most = self.policy.max_rows
        kept = 0 if keep is None else int(np.unique(keep).shape[0])
        if n + kept > most:
            raise ValueError(f"table {self.spec.name!r}: {n + kept} rows in one pull or "
                             f"push exceed its {most} rows on PS {self.ps_id} (max_rows)")
        over = self.live_rows + n - most
        if over <= 0:
            return
        assert self.touched is not None
        need = min(self.live_rows, over + most // 64)
        self.evict(lru_victims(self.touched, self.row_ids, self.size, need, self._rng, keep),
                   "capacity")

    def sweep(self: TableLike) -> int:
        """One step of the TTL sweep: up to ``sweep_rows`` slots (lock held), and one of
        the id index's compaction (4 x ``sweep_rows`` entries); returns the rows
        evicted."""
        if self.policy.evicts:
            self._index.compact_step(4 * self.policy.sweep_rows)
        ttl = self.policy.ttl_versions
        if self.clock is not None:   # a TTL in seconds: either evicts
            by_time = self.clock.ttl_versions(self.now)
            if by_time > 0:
                ttl = by_time if ttl <= 0 else min(ttl, by_time)
        if ttl <= 0 or self.size == 0 or self.touched is None:
            return 0
        lo = self._sweep_pos if self._sweep_pos < self.size else 0
        hi = min(lo + self.policy.sweep_rows, self.size)
        self._sweep_pos = hi if hi < self.size else 0   # the next pass from the start
        return self.evict(ttl_victims(self.touched, self.row_ids, lo, hi, self.now, ttl))

    def take_evicted(self: TableLike) -> Optional[np.ndarray]:
        """The ids evicted since the last call (for a checkpoint's record); None when
        there were more than ``EVICTED_LOG_MAX`` (not recorded)."""
        out = None if self._evicted_lost else \
            np.concatenate(self._evicted) if self._evicted else np.zeros(0, np.int64)
        self._evicted.clear()
        self._evicted_n, self._evicted_lost = 0, False
        return out
