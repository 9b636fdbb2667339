"""What one parameter server holds: its dense parameters and embedding rows.

Placement, initializers and :class:`~elasticdl.common.tables.TableSpec` are shared with the
layers, the worker and the checkpoints (:mod:`elasticdl.common.tables`): a dense parameter
lives on PS ``crc32(name) % num_ps``, row ``id`` of every embedding table on PS
``id % num_ps``.

A table's rows either come with it (``TableSpec.explicit``: the worker that
initialises the PS pushes the rows its model code produced, this PS's part as
``TableSpec.rows``, so the PS starts from exactly the local table) or are
created lazily, on the first pull that names them, with the table's
initializer (tables too big to materialise), so a table can be exported whole
without ever creating all of its rows on a PS.

Rows are found by a vectorised index (local index ``id // num_ps`` -> slot
in one big weight tensor), so a pull of a million ids is a couple of
numpy/torch gathers (:mod:`elasticdl.ps.slot_index`). The index is lazy like the rows:
for up to ``DIRECT_INDEX_MAX`` local ids a direct array (at most 32 MiB, allocated
when the first row is created); beyond, a sorted id array searched with
``np.searchsorted``, whose size grows with the rows created (16 bytes per
row), so a 2^31-id table costs nothing until rows are touched.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from elasticdl.common.tables import TableSpec, dense_owner, local_rows
from elasticdl.ps import row_arena
from elasticdl.ps.admission import CountingSketch
from elasticdl.ps.eviction import EmbeddingDefaults, TablePolicy, VersionClock
from elasticdl.ps.row_policy import RowPolicy
from elasticdl.ps.row_snapshot import TableSnapshot
from elasticdl.ps.slot_index import SlotIndex

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ tables
NO_POLICY = TablePolicy()          # admission and eviction off
NO_DEFAULTS = EmbeddingDefaults()


class EmbeddingTable(RowPolicy):
    """This PS's rows of one table, plus per-row optimizer state.

    Rows live in ``weights[:size]``; ``row_ids[:size]`` says which id each
    slot holds; ``state[name][:size]`` are optimizer statistics aligned with
    the rows (created by :meth:`ensure_state`). ``dirty[:size]`` marks the rows created
    or updated since the last checkpoint's cut (a delta's rows); ``snapshot``, while a
    checkpoint copies this table, is told of every update first (:meth:`before_update`).

    With a :class:`~elasticdl.ps.eviction.TablePolicy` that admits or evicts: ``sketch``
    counts the ids without a row, ``touched[:size]`` holds each row's last-update model
    version (uint32), an evicted row's slot holds id -1 and is reused by the next row
    created (with fresh optimizer state); ``now`` is the model version (the shard's).
    """

    def __init__(self, spec: TableSpec, ps_id: int, num_ps: int, capacity: int = 1024,
                 policy: TablePolicy = NO_POLICY):
        self.spec = spec
        self.ps_id = ps_id
        self.num_ps = num_ps
        self.policy = policy
        self.now = 0
        self.stats = {"admitted": 0, "evicted_ttl": 0, "evicted_capacity": 0,
                      "grads_dropped": 0}
        self.sketch = CountingSketch(policy.sketch_counters) if self.policy.admits else None
        self._free = np.zeros(0, dtype=np.int64)   # evicted slots, reused first
        self._nfree = 0
        self._evicted: list[np.ndarray] = []       # ids evicted since the last cut
        self._evicted_n = 0
        self._evicted_lost = False   # more than EVICTED_LOG_MAX since the last cut
        self._record_evicted = False  # from the first checkpoint cut on (deltas need it)
        self._sweep_pos = 0
        self._rng = np.random.default_rng(ps_id)
        self.clock = VersionClock(policy.ttl_seconds) if policy.ttl_seconds > 0 else None
        self.touched: Optional[np.ndarray] = None
        # a table that evicts has no dirty marks: a row is dirty when its last-update
        # version is at least the version of the last cut (``_cut_at``): 4 B a row for
        # both, where the marks would add a byte (docs/parameter_server.md)
        self._stamped = self.policy.evicts
        self._cut_at = 0
        local = local_rows(spec.num_embeddings, ps_id, num_ps)
        capacity = min(capacity, max(local, 1))
        self.weights = torch.empty((capacity, spec.dim), dtype=spec.dtype)
        self.row_ids = np.empty(capacity, dtype=np.int64)
        self.dirty = np.zeros(0 if self._stamped else capacity, dtype=bool)
        # a big lazy table: rows over reserved address space (row_arena), never copied
        self._reserved = 0
        if spec.rows is None:
            most = row_arena.reserve_rows(spec.dim * self.weights.element_size(), local)
            weights = row_arena.reserve(most, (spec.dim,), spec.dtype)
            row_ids = row_arena.array(most, np.int64) if weights is not None else None
            marks = None if row_ids is None else row_arena.array(
                most, np.uint32 if self._stamped else np.bool_)
            if weights is not None and row_ids is not None and marks is not None:
                self.weights, self.row_ids = weights, row_ids
                if self._stamped:
                    self.touched = marks
                else:
                    self.dirty = marks
                self._reserved = most
        if self.policy.evicts and self.touched is None:
            self.touched = np.zeros(self.weights.shape[0], dtype=np.uint32)
        self._index = SlotIndex(local, self._reserved)
        self.snapshot: Optional[TableSnapshot] = None
        self.state: dict[str, torch.Tensor] = {}
        self._state_fill: dict[str, float] = {}
        self.size = 0
        if spec.rows is not None:
            rows = spec.rows
            self.spec = replace(spec, rows=None)  # the table holds them from now on
            if not spec.explicit:
                raise ValueError(f"table {spec.name!r}: rows given for a table that is not "
                                 "explicit")
            if tuple(rows.shape) != (local, spec.dim) or rows.dtype != spec.dtype:
                raise ValueError(f"table {spec.name!r}: PS {ps_id} of {num_ps} expects initial "
                                 f"rows {spec.dtype} {(local, spec.dim)}, got {rows.dtype} "
                                 f"{tuple(rows.shape)}")
            # every row at once: the table adopts the tensor (no copy)
            self.weights = rows.contiguous()
            self.row_ids = np.arange(ps_id, spec.num_embeddings, num_ps, dtype=np.int64)
            self._index.insert(self.row_ids // num_ps, np.arange(local, dtype=np.int64))
            if self._stamped:
                self.touched = np.zeros(local, dtype=np.uint32)   # dirty (>= _cut_at 0)
            else:
                self.dirty = np.ones(local, dtype=bool)
            self.size = local

    def ensure_state(self, name: str, fill: float = 0.0, per_row_scalar: bool = False) -> None:
        """Create a per-row optimizer statistic (rows x dim, or rows for a scalar)."""
        if name in self.state:
            return
        cap = self.weights.shape[0]
        tail = () if per_row_scalar else (self.spec.dim,)
        dtype = torch.float64 if per_row_scalar else self.spec.dtype
        self._state_fill[name] = fill
        if self._reserved:
            reserved = row_arena.reserve(cap, tail, dtype)   # zeros, no page touched
            if reserved is not None:
                if fill != 0.0:
                    reserved[:self.size] = fill   # later rows: as they are added
                self.state[name] = reserved
                return
            self._leave_arena(self.size)
            cap = self.weights.shape[0]
        self.state[name] = torch.full((cap,) + tail, fill, dtype=dtype)

    def default_rows(self, ids: np.ndarray) -> torch.Tensor:
        """What a row without a row answers (and starts from when created): the
        initializer's row of the id; zeros for a table whose rows were pushed whole
        (a row of it exists only once evicted or not admitted: a policy is on)."""
        if self.spec.explicit:
            if not (self.policy.admits or self.policy.evicts):
                return self.spec.initial_rows(ids)   # raises: the rows must all exist
            return torch.zeros((ids.shape[0], self.spec.dim), dtype=self.spec.dtype)
        return self.spec.initial_rows(ids)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id (of this PS, unchecked); -1 where it has no row."""
        return self._index.find(ids // self.num_ps)

    def check_ids(self, ids: np.ndarray, what: str = "") -> None:
        """Raises ValueError if an id is out of range or belongs to another PS."""
        if ids.size == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        name = what or f"table {self.spec.name!r}"
        if lo < 0 or hi >= self.spec.num_embeddings:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name}: id {bad} out of range [0, {self.spec.num_embeddings})")
        if self.num_ps > 1:
            wrong = ids % self.num_ps != self.ps_id
            if wrong.any():
                raise ValueError(f"{name}: id {int(ids[wrong][0])} belongs to PS "
                                 f"{int(ids[wrong][0]) % self.num_ps}, not PS {self.ps_id}")

    def slots(self, ids: np.ndarray, create: bool = True) -> torch.Tensor:
        """Slot of each id (validated), creating missing rows when ``create``."""
        self.check_ids(ids)
        local = ids // self.num_ps
        slots = self._index.find(local)
        missing = slots < 0
        if missing.any():
            if not create:
                raise ValueError(f"table {self.spec.name!r}: rows {ids[missing][:5].tolist()} "
                                 "were never created")
            new_ids = np.unique(ids[missing])
            self._add_rows(new_ids, self.default_rows(new_ids), keep=slots[~missing])
            slots = self._index.find(local)
        return torch.from_numpy(slots)

    def _leave_arena(self, need: int) -> None:
        """Move the rows to ordinary tensors (the reserved space is exhausted or a
        reservation was refused); they grow by doubling from now on."""
        self._reserved = 0
        self._grow(need, force=True)

    def _grow(self, need: int, force: bool = False) -> None:
        cap = self.weights.shape[0]
        if need <= cap and not force:
            return
        if self._reserved:
            self._leave_arena(need)
            return
        new_cap = max(need, 2 * self.size, 1024)
        weights = torch.empty((new_cap, self.spec.dim), dtype=self.spec.dtype)
        weights[:self.size] = self.weights[:self.size]
        self.weights = weights
        row_ids = np.empty(new_cap, dtype=np.int64)
        row_ids[:self.size] = self.row_ids[:self.size]
        self.row_ids = row_ids
        if not self._stamped:
            dirty = np.zeros(new_cap, dtype=bool)
            dirty[:self.size] = self.dirty[:self.size]
            self.dirty = dirty
        if self.touched is not None:
            touched = np.zeros(new_cap, dtype=np.uint32)
            touched[:self.size] = self.touched[:self.size]
            self.touched = touched
        for name, old in self.state.items():
            grown = torch.full((new_cap,) + tuple(old.shape[1:]), self._state_fill[name],
                               dtype=old.dtype)
            grown[:self.size] = old[:self.size]
            self.state[name] = grown

    def _add_rows(self, ids: np.ndarray, values: torch.Tensor,
                  state: Optional[Mapping[str, torch.Tensor]] = None,
                  keep: Optional[np.ndarray] = None, bounded: bool = True) -> None:
        """Rows for ``ids`` (absent); a capacity bound evicts rows first, never those in
        the slots ``keep`` (the other rows of the same pull or push)."""
        n = ids.shape[0]
        if self.policy.max_rows and bounded:
            self._make_room(n, keep)
        given = state or {}
        k = min(n, self._nfree)
        if k:   # evicted slots first: their rows start as new ones (optimizer state fresh)
            reused = self._free[self._nfree - k:self._nfree].copy()
            self._nfree -= k
            rt = torch.from_numpy(reused)
            self.before_update(rt)   # a snapshot being copied keeps the slot as it was
            self.weights.index_copy_(0, rt, values[:k].to(self.weights.dtype))
            self.row_ids[reused] = ids[:k]
            self._mark_dirty(reused)
            self._index.insert(ids[:k] // self.num_ps, reused)
            for name, rows in self.state.items():
                rows.index_copy_(0, rt, given[name][:k].to(rows.dtype) if name in given else
                                 rows.new_full((k,) + tuple(rows.shape[1:]),
                                               self._state_fill[name]))
            if self.touched is not None:
                self.touched[reused] = self.now
            if k == n:
                return
            ids, values = ids[k:], values[k:]
            given = {name: v[k:] for name, v in given.items()}
            n -= k
        start = self.size
        self._grow(start + n)
        self.weights[start:start + n] = values
        self.row_ids[start:start + n] = ids
        if not self._stamped:   # (a stamped table: the versions below say it)
            self.dirty[start:start + n] = True
        self._index.insert(ids // self.num_ps, np.arange(start, start + n, dtype=np.int64))
        for name, rows in self.state.items():
            if name in given:
                rows[start:start + n] = given[name]
            elif self._reserved and self._state_fill[name] != 0.0:
                rows[start:start + n] = self._state_fill[name]
        if self.touched is not None:
            self.touched[start:start + n] = self.now
        self.size = start + n

    def _mark_dirty(self, slots: np.ndarray) -> None:
        """Rows ``slots`` belong to the next delta."""
        if self._stamped:
            assert self.touched is not None
            self.touched[slots] = self.now
        else:
            self.dirty[slots] = True

    def _dirty_slots(self, n: int) -> np.ndarray:
        """Slots of ``[0, n)`` changed since the last cut (created, updated, evicted)."""
        if self._stamped:
            assert self.touched is not None
            return np.flatnonzero(self.touched[:n] >= self._cut_at)
        return np.flatnonzero(self.dirty[:n])

    def start_clock(self, version: int) -> None:
        """The model version now; rows present (pushed whole) count as updated now."""
        self.set_now(version)
        if self.touched is not None and self.size:
            self.touched[:self.size] = np.maximum(self.touched[:self.size], self.now)

    def before_update(self, slots: torch.Tensor) -> None:
        """Rows ``slots`` are about to change (lock held): they belong to the next
        delta, and a snapshot being copied takes them as they are first."""
        s = slots.numpy()
        if self.snapshot is not None:   # first: a stamped table's mark is its clock
            self.snapshot.preserve(s)
        self._mark_dirty(s)

    def cut(self, full: bool) -> TableSnapshot:
        """Start a snapshot of every row (``full``) or of the rows changed since the
        last cut, and clear the dirty marks (lock held; the copy runs later)."""
        if self.snapshot is not None:
            self.snapshot.finish()
        n = self.size
        snap = TableSnapshot(self, None if full else self._dirty_slots(n))
        snap.evicted = self.take_evicted()
        self._record_evicted = True
        snap.partial = self.policy.admits or self.policy.evicts
        if self._stamped:
            self._cut_at = self.now   # rows stamped from now on are the next delta's
        else:
            self.dirty[:n] = False
        self.snapshot = snap
        return snap

    def lookup(self, ids: np.ndarray, create: bool = True) -> torch.Tensor:
        """Rows of ``ids``, shape (len(ids), dim). New rows are created, or with
        ``create=False`` returned with their initial values and not stored."""
        if create and self.sketch is not None:
            self.check_ids(ids)
            found = self._index.find(ids // self.num_ps)
            if (found < 0).any():
                self._admit(np.unique(ids[found < 0]), found[found >= 0])
            return self.lookup(ids, create=False)
        if create:
            slots = self.slots(ids)  # first: creating rows may replace self.weights
            return self.weights.index_select(0, slots)
        self.check_ids(ids)
        slots_np = self._index.find(ids // self.num_ps)
        present = slots_np >= 0
        if present.all():
            return self.weights.index_select(0, torch.from_numpy(slots_np))
        out = self.default_rows(ids)
        if present.any():
            mask = torch.from_numpy(present)
            out[mask] = self.weights.index_select(0, torch.from_numpy(slots_np[present]))
        return out

    @property
    def nbytes(self) -> int:
        """Memory the rows, their state and the index take: the rows in use when they
        are over reserved address space (row_arena), else the allocated capacity."""
        rows = self.size if self._reserved else self.weights.shape[0]
        per_row = self.weights.element_size() * self.spec.dim + self.row_ids.itemsize + \
            (0 if self._stamped else self.dirty.itemsize) + \
            sum(v.element_size() * (v.nelement() // max(v.shape[0], 1))
                for v in self.state.values())
        if self.touched is not None:
            per_row += self.touched.itemsize
        sketch = 0 if self.sketch is None else self.sketch.nbytes
        return rows * per_row + self._index.nbytes + sketch

    @property
    def state_fill(self) -> dict[str, float]:
        """The value each optimizer statistic starts from (a row never updated)."""
        return dict(self._state_fill)

    def state_dict(self) -> dict[str, object]:
        live = torch.from_numpy(np.flatnonzero(self.row_ids[:self.size] >= 0))
        return {"spec": self.spec.to_dict(),
                "ids": torch.from_numpy(self.row_ids[live.numpy()]),
                "weights": self.weights.index_select(0, live),
                "state": {k: v.index_select(0, live) for k, v in self.state.items()},
                "state_fill": dict(self._state_fill)}

    def load_rows(self, ids: np.ndarray, weights: torch.Tensor,
                  state: Mapping[str, torch.Tensor], state_fill: Mapping[str, float],
                  clocks: Optional[np.ndarray] = None) -> None:
        """Add restored rows (ids not yet present, belonging to this PS); ``clocks``,
        their last-update versions where the checkpoint kept them (else they count as
        updated at the restore)."""
        start, reuse = self.size, self._nfree
        self._load_rows(ids, weights, state, state_fill)
        if clocks is None or self.touched is None or ids.shape[0] == 0:
            return
        stamps = np.minimum(np.asarray(clocks).view(np.uint32), self.now)
        if reuse == 0 and self.size == start + ids.shape[0]:   # appended in order
            self.touched[start:self.size] = stamps
        else:
            self.touched[self._index.find(ids // self.num_ps)] = stamps

    def _load_rows(self, ids: np.ndarray, weights: torch.Tensor,
                   state: Mapping[str, torch.Tensor], state_fill: Mapping[str, float]) -> None:
        self.check_ids(ids, f"restored table {self.spec.name!r}")
        for name, fill in state_fill.items():
            per_row = state[name].dim() == 1 if name in state else False
            self.ensure_state(name, fill, per_row_scalar=per_row)
        most = self.policy.max_rows
        if most and self.live_rows + ids.shape[0] > most:
            # a checkpoint of more rows than the bound (written without it, or with a
            # higher one): all are restored; the next rows created evict the excess
            logger.warning("table %r: %d restored rows exceed max_rows %d on PS %d; the "
                           "least recently updated go as new rows come", self.spec.name,
                           self.live_rows + ids.shape[0], most, self.ps_id)
            self._add_rows(ids, weights.to(self.spec.dtype), state, bounded=False)
            return
        self._add_rows(ids, weights.to(self.spec.dtype), state)


# ------------------------------------------------------------- the shard
class Parameters:
    """Dense parameters, buffers and embedding tables of one PS shard."""

    def __init__(self, ps_id: int, num_ps: int,
                 embedding: EmbeddingDefaults = NO_DEFAULTS):
        if not 0 <= ps_id < num_ps:
            raise ValueError(f"ps_id {ps_id} out of range for {num_ps} PS")
        self.ps_id = ps_id
        self.num_ps = num_ps
        self.embedding = embedding
        self.dense: dict[str, torch.nn.Parameter] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.tables: dict[str, EmbeddingTable] = {}
        self.initialized = False
        self.version = 0

    def owns_dense(self, name: str) -> bool:
        return dense_owner(name, self.num_ps) == self.ps_id

    def initialize(self, version: int, dense: Mapping[str, torch.Tensor],
                   buffers: Mapping[str, torch.Tensor], tables: Iterable[TableSpec]) -> None:
        """Take the model a worker pushed (or a checkpoint holds).

        Raises:
            ValueError: a dense name placed on another PS, or a duplicate table.
        """
        for name in list(dense) + list(buffers):
            if not self.owns_dense(name):
                raise ValueError(f"parameter {name!r} belongs to PS "
                                 f"{dense_owner(name, self.num_ps)}, not PS {self.ps_id}")
        new_tables: dict[str, EmbeddingTable] = {}
        for spec in tables:
            if spec.name in new_tables:
                raise ValueError(f"embedding table {spec.name!r} declared twice")
            policy = self.embedding.policy(spec.admit_after, spec.ttl_versions, spec.max_rows,
                                           self.num_ps, spec.ttl_seconds)
            new_tables[spec.name] = EmbeddingTable(spec, self.ps_id, self.num_ps,
                                                   policy=policy)
        self.dense = {n: torch.nn.Parameter(t.detach().to("cpu").clone(),
                                            requires_grad=t.dtype.is_floating_point)
                      for n, t in dense.items()}
        self.buffers = {n: t.detach().to("cpu").clone() for n, t in buffers.items()}
        self.tables = new_tables
        self.version = int(version)
        for t in new_tables.values():
            t.start_clock(self.version)
        self.initialized = True
        logger.info("PS %d initialised at version %d: %d dense (%.1f MB), %d buffers, "
                    "%d tables", self.ps_id, self.version, len(self.dense),
                    sum(p.numel() * p.element_size() for p in self.dense.values()) / 1e6,
                    len(self.buffers), len(self.tables))

    def set_clock(self, version: int) -> None:
        """The model version rows created or updated from now on are stamped with."""
        for t in self.tables.values():
            t.set_now(version)

    def table(self, name: str) -> EmbeddingTable:
        try:
            return self.tables[name]
        except KeyError:
            raise ValueError(f"unknown embedding table {name!r}") from None
