"""What one parameter server holds: its dense parameters and embedding rows.

Placement: a dense parameter lives on PS ``crc32(name) % num_ps``,
row ``id`` of every embedding table on PS ``id % num_ps``.

A table's rows either come with it (``TableSpec.explicit``: the worker that
initialises the PS pushes the rows its model code produced, this PS's part as
``TableSpec.rows``, so the PS starts from exactly the local table) or are
created lazily, on the first pull that names them, with the table's
initializer (tables too big to materialise). An initializer is a pure function of ``(seed, id)``
(a counter-based hash, no RNG state; each layer draws its seed from torch's
generator when it is built), so a row has
the same initial value whichever PS creates it, in whatever order, and the
same as the local table of :class:`elasticdl.api.layers.Embedding`; a table
can be exported whole without ever creating all of its rows on a PS.

Rows are found by a vectorised index (local index ``id // num_ps`` -> slot
in one big weight tensor), so a pull of a million ids is a couple of
numpy/torch gathers. The index is lazy like the rows: for up to
``DIRECT_INDEX_MAX`` local ids a direct array (at most 32 MiB, allocated
when the first row is created); beyond, a sorted id array searched with
``np.searchsorted``, whose size grows with the rows created (16 bytes per
row), so a 2^31-id table costs nothing until rows are touched.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np
import torch

from elasticdl.common.tensor_codec import dtype_name, torch_dtype

logger = logging.getLogger(__name__)


def dense_owner(name: str, num_ps: int) -> int:
    """PS index of a dense parameter: a stable hash of its name (not Python's ``hash``)."""
    return zlib.crc32(name.encode("utf-8")) % num_ps


# ------------------------------------------------------------ initializers
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _uniform01(seed: int, ids: np.ndarray, width: int) -> np.ndarray:
    """Deterministic uniforms in (0, 1), shape (len(ids), width)."""
    key = np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        base = _mix64(ids.astype(np.uint64) ^ _mix64(np.array([key], dtype=np.uint64)))
        cols = np.arange(width, dtype=np.uint64)
        z = _mix64(base[:, None] * np.uint64(0x2545F4914F6CDD1D) + cols[None, :])
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def parse_initializer(spec: str) -> tuple[str, tuple[float, ...]]:
    """``"normal"``, ``"normal:STD"``, ``"uniform:LOW:HIGH"``, ``"zeros"``, ``"constant:V"``.

    Raises:
        ValueError: unknown kind or bad arguments.
    """
    kind, *args = (spec or "normal").split(":")
    try:
        values = tuple(float(a) for a in args)
    except ValueError:
        raise ValueError(f"initializer {spec!r}: arguments must be numbers") from None
    defaults = {"normal": (1.0,), "uniform": (-0.05, 0.05), "zeros": (), "constant": (0.0,)}
    if kind not in defaults:
        raise ValueError(f"unknown initializer {spec!r}; use normal[:std], "
                         f"uniform[:low:high], zeros or constant:value")
    if values and len(values) != len(defaults[kind]):
        raise ValueError(f"initializer {spec!r}: {kind} takes {len(defaults[kind])} argument(s)")
    return kind, values or defaults[kind]


def initial_rows(spec: str, seed: int, ids: np.ndarray, dim: int,
                 dtype: torch.dtype = torch.float32, padding_idx: int = -1) -> torch.Tensor:
    """Initial values of rows ``ids`` of a table, shape (len(ids), dim)."""
    kind, args = parse_initializer(spec)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if kind == "normal":
        u = _uniform01(seed, ids, 2 * dim)
        values = np.sqrt(-2.0 * np.log(u[:, :dim])) * np.cos(2.0 * np.pi * u[:, dim:])
        values *= args[0]
    elif kind == "uniform":
        values = args[0] + (args[1] - args[0]) * _uniform01(seed, ids, dim)
    else:
        values = np.full((ids.shape[0], dim), args[0] if args else 0.0)
    out = torch.from_numpy(values).to(dtype)
    if padding_idx >= 0:
        out[torch.from_numpy(ids == padding_idx)] = 0
    return out


# ------------------------------------------------------------------ tables
DIRECT_INDEX_MAX = 1 << 22


def local_rows(num_embeddings: int, ps_id: int, num_ps: int) -> int:
    """How many rows of a table PS ``ps_id`` owns (ids ``ps_id + k * num_ps``)."""
    return max(0, (num_embeddings - ps_id + num_ps - 1) // num_ps)


class SlotIndex:
    """Local id -> slot of the rows present (-1: absent), vectorised."""

    def __init__(self, local_size: int):
        self.direct = local_size <= DIRECT_INDEX_MAX
        self._local_size = max(local_size, 0)
        self._array: Optional[np.ndarray] = None  # direct mode
        self._keys = np.empty(0, dtype=np.int64)  # sorted mode
        self._values = np.empty(0, dtype=np.int64)

    def find(self, local: np.ndarray) -> np.ndarray:
        if self.direct:
            if self._array is None:
                return np.full(local.shape[0], -1, dtype=np.int64)
            return self._array[local]
        if self._keys.shape[0] == 0:
            return np.full(local.shape[0], -1, dtype=np.int64)
        pos = np.searchsorted(self._keys, local)
        np.minimum(pos, self._keys.shape[0] - 1, out=pos)
        return np.where(self._keys[pos] == local, self._values[pos], -1)

    def insert(self, local: np.ndarray, slots: np.ndarray) -> None:
        """Add ids not present yet."""
        if self.direct:
            if self._array is None:
                self._array = np.full(self._local_size, -1, dtype=np.int64)
            self._array[local] = slots
            return
        order = np.argsort(local, kind="stable")
        local, slots = local[order], slots[order]
        pos = np.searchsorted(self._keys, local)
        self._keys = np.insert(self._keys, pos, local)
        self._values = np.insert(self._values, pos, slots)

    @property
    def nbytes(self) -> int:
        if self.direct:
            return 0 if self._array is None else self._array.nbytes
        return self._keys.nbytes + self._values.nbytes


@dataclass(frozen=True)
class TableSpec:
    """An embedding table as its layer declares it."""

    name: str
    num_embeddings: int
    dim: int
    initializer: str = "normal"
    seed: int = 0
    padding_idx: int = -1
    dtype: torch.dtype = torch.float32
    # rows given by the pusher instead of the initializer; ``rows`` (this PS's part,
    # ids ps_id, ps_id + num_ps, ... in order) only travels into EmbeddingTable
    explicit: bool = False
    rows: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("embedding table without a name")
        if self.num_embeddings <= 0 or self.dim <= 0:
            raise ValueError(f"table {self.name!r}: num_embeddings and dim must be > 0, got "
                             f"{self.num_embeddings} x {self.dim}")
        if not -1 <= self.padding_idx < self.num_embeddings:
            raise ValueError(f"table {self.name!r}: padding_idx {self.padding_idx} out of range")
        if not self.dtype.is_floating_point:
            raise ValueError(f"table {self.name!r}: dtype must be floating point")
        parse_initializer(self.initializer)

    def initial_rows(self, ids: np.ndarray) -> torch.Tensor:
        """Initial values of rows ``ids``.

        Raises:
            ValueError: the table's rows were given explicitly (there is no initializer).
        """
        if self.explicit:
            raise ValueError(f"table {self.name!r} was initialised with explicit rows; rows "
                             f"{np.asarray(ids).reshape(-1)[:5].tolist()} are missing")
        return initial_rows(self.initializer, self.seed, ids, self.dim, self.dtype,
                            self.padding_idx)

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "num_embeddings": self.num_embeddings, "dim": self.dim,
                "initializer": self.initializer, "seed": self.seed,
                "padding_idx": self.padding_idx, "dtype": dtype_name(self.dtype),
                "explicit": self.explicit}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> TableSpec:
        values = dict(d)
        values["dtype"] = torch_dtype(str(values["dtype"]))
        return cls(**values)  # type: ignore[arg-type]


class EmbeddingTable:
    """This PS's rows of one table, plus per-row optimizer state.

    Rows live in ``weights[:size]``; ``row_ids[:size]`` says which id each
    slot holds; ``state[name][:size]`` are optimizer statistics aligned with
    the rows (created by :meth:`ensure_state`).
    """

    def __init__(self, spec: TableSpec, ps_id: int, num_ps: int, capacity: int = 1024):
        self.spec = spec
        self.ps_id = ps_id
        self.num_ps = num_ps
        local = local_rows(spec.num_embeddings, ps_id, num_ps)
        self._index = SlotIndex(local)
        capacity = min(capacity, max(local, 1))
        self.weights = torch.empty((capacity, spec.dim), dtype=spec.dtype)
        self.row_ids = np.empty(capacity, dtype=np.int64)
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
            self.size = local

    def ensure_state(self, name: str, fill: float = 0.0, per_row_scalar: bool = False) -> None:
        """Create a per-row optimizer statistic (rows x dim, or rows for a scalar)."""
        if name in self.state:
            return
        cap = self.weights.shape[0]
        shape = (cap,) if per_row_scalar else (cap, self.spec.dim)
        dtype = torch.float64 if per_row_scalar else self.spec.dtype
        self.state[name] = torch.full(shape, fill, dtype=dtype)
        self._state_fill[name] = fill

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
            self._add_rows(new_ids, self.spec.initial_rows(new_ids))
            slots = self._index.find(local)
        return torch.from_numpy(slots)

    def _grow(self, need: int) -> None:
        cap = self.weights.shape[0]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)
        weights = torch.empty((new_cap, self.spec.dim), dtype=self.spec.dtype)
        weights[:self.size] = self.weights[:self.size]
        self.weights = weights
        row_ids = np.empty(new_cap, dtype=np.int64)
        row_ids[:self.size] = self.row_ids[:self.size]
        self.row_ids = row_ids
        for name, old in self.state.items():
            grown = torch.full((new_cap,) + tuple(old.shape[1:]), self._state_fill[name],
                               dtype=old.dtype)
            grown[:self.size] = old[:self.size]
            self.state[name] = grown

    def _add_rows(self, ids: np.ndarray, values: torch.Tensor,
                  state: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        n = ids.shape[0]
        start = self.size
        self._grow(start + n)
        self.weights[start:start + n] = values
        self.row_ids[start:start + n] = ids
        self._index.insert(ids // self.num_ps, np.arange(start, start + n, dtype=np.int64))
        for name, rows in (state or {}).items():
            if name in self.state:
                self.state[name][start:start + n] = rows
        self.size = start + n

    def lookup(self, ids: np.ndarray, create: bool = True) -> torch.Tensor:
        """Rows of ``ids``, shape (len(ids), dim). New rows are created, or with
        ``create=False`` returned with their initial values and not stored."""
        if create:
            slots = self.slots(ids)  # first: creating rows may replace self.weights
            return self.weights.index_select(0, slots)
        self.check_ids(ids)
        slots_np = self._index.find(ids // self.num_ps)
        present = slots_np >= 0
        if present.all():
            return self.weights.index_select(0, torch.from_numpy(slots_np))
        out = self.spec.initial_rows(ids)
        if present.any():
            mask = torch.from_numpy(present)
            out[mask] = self.weights.index_select(0, torch.from_numpy(slots_np[present]))
        return out

    def state_dict(self) -> dict[str, object]:
        n = self.size
        return {"spec": self.spec.to_dict(), "ids": torch.from_numpy(self.row_ids[:n].copy()),
                "weights": self.weights[:n].clone(),
                "state": {k: v[:n].clone() for k, v in self.state.items()},
                "state_fill": dict(self._state_fill)}

    def load_rows(self, ids: np.ndarray, weights: torch.Tensor,
                  state: Mapping[str, torch.Tensor], state_fill: Mapping[str, float]) -> None:
        """Add restored rows (ids not yet present, belonging to this PS)."""
        self.check_ids(ids, f"restored table {self.spec.name!r}")
        for name, fill in state_fill.items():
            per_row = state[name].dim() == 1 if name in state else False
            self.ensure_state(name, fill, per_row_scalar=per_row)
        self._add_rows(ids, weights.to(self.spec.dtype), state)


# ------------------------------------------------------------- the shard
class Parameters:
    """Dense parameters, buffers and embedding tables of one PS shard."""

    def __init__(self, ps_id: int, num_ps: int):
        if not 0 <= ps_id < num_ps:
            raise ValueError(f"ps_id {ps_id} out of range for {num_ps} PS")
        self.ps_id = ps_id
        self.num_ps = num_ps
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
            new_tables[spec.name] = EmbeddingTable(spec, self.ps_id, self.num_ps)
        self.dense = {n: torch.nn.Parameter(t.detach().to("cpu").clone(),
                                            requires_grad=t.dtype.is_floating_point)
                      for n, t in dense.items()}
        self.buffers = {n: t.detach().to("cpu").clone() for n, t in buffers.items()}
        self.tables = new_tables
        self.version = int(version)
        self.initialized = True
        logger.info("PS %d initialised at version %d: %d dense (%.1f MB), %d buffers, "
                    "%d tables", self.ps_id, self.version, len(self.dense),
                    sum(p.numel() * p.element_size() for p in self.dense.values()) / 1e6,
                    len(self.buffers), len(self.tables))

    def table(self, name: str) -> EmbeddingTable:
        try:
            return self.tables[name]
        except KeyError:
            raise ValueError(f"unknown embedding table {name!r}") from None
