"""Embedding tables as a model declares them, and where their parts live.

Shared by the layer that declares a table (:class:`elasticdl.api.layers.Embedding`), the
worker that pushes it, the PS that holds it and the checkpoint that saves it:

* placement: a dense parameter lives on PS ``crc32(name) % num_ps`` (:func:`dense_owner`),
  row ``id`` of every embedding table on PS ``id % num_ps`` (:func:`local_rows`);
* initializers: a pure function of ``(seed, id)`` (a counter-based hash, no RNG state; each
  layer draws its seed from torch's generator when it is built), so a row has the same
  initial value whichever PS creates it, in whatever order, and the same as the local table
  of the layer (:func:`initial_rows`);
* :class:`TableSpec`: a table's name, shape, initializer, dtype.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from elasticdl.common.tensor_codec import dtype_name, torch_dtype


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


def local_rows(num_embeddings: int, ps_id: int, num_ps: int) -> int:
    """How many rows of a table PS ``ps_id`` owns (ids ``ps_id + k * num_ps``)."""
    return max(0, (num_embeddings - ps_id + num_ps - 1) // num_ps)


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
    # admission and eviction on the PS (docs/parameter_server.md); None: the job's flag
    admit_after: Optional[int] = None    # a row for an id on its Nth training pull
    ttl_versions: Optional[int] = None   # evict rows not updated for this many versions
    max_rows: Optional[int] = None       # rows of the table, all PS together (LRU beyond)
    ttl_seconds: Optional[float] = None  # evict rows not updated for this many seconds

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
        for what, value, low in (("admit_after", self.admit_after, 1),
                                 ("ttl_versions", self.ttl_versions, 0),
                                 ("max_rows", self.max_rows, 0),
                                 ("ttl_seconds", self.ttl_seconds, 0)):
            if value is not None and value < low:
                raise ValueError(f"table {self.name!r}: {what} must be >= {low}, got {value}")

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
                "explicit": self.explicit, "admit_after": self.admit_after,
                "ttl_versions": self.ttl_versions, "max_rows": self.max_rows,
                "ttl_seconds": self.ttl_seconds}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> TableSpec:
        values = dict(d)
        values["dtype"] = torch_dtype(str(values["dtype"]))
        return cls(**values)  # type: ignore[arg-type]
