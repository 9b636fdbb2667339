"""Embedding tables exported sparse: the rows that exist, beside ``model.pt``.

A table of 2^31 ids of which 1e5 were trained cannot be written whole (64 GiB for 8
floats a row). A job's export writes such tables (those of at least
``--export_sparse_min_elements`` elements) as their rows that exist, and ``model.pt``
keeps everything else (dense parameters, buffers, small tables)::

    <output>/model.pt                         plain state dict, without the sparse tables
    <output>/sparse_tables/tables.json        {"format": 1, "tables": {name: {...}}}
    <output>/sparse_tables/<name>/part-K.pt   {"ids": int64 (sorted), "values": rows}

Each table's entry holds its :class:`~elasticdl.common.tables.TableSpec` (so inference
gives an id never trained the value the trained model gave it: the initializer's row of a
lazy table), its row count and its part files; each part holds at most
``rows_per_part`` rows, ids sorted within the part (parts of different PS interleave).
Writing and reading cost memory in the rows that exist, never in the table's size.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from elasticdl.common.tables import TableSpec

SPARSE_DIR = "sparse_tables"
MANIFEST = "tables.json"
FORMAT = 1
ROWS_PER_PART = 1 << 20


@dataclass(frozen=True)
class SparseRows:
    """The rows of one table that exist: ``ids`` sorted, ``values[i]`` the row of ``ids[i]``."""

    spec: TableSpec
    ids: np.ndarray
    values: torch.Tensor

    def lookup(self, ids: np.ndarray) -> torch.Tensor:
        """Rows of ``ids``: stored rows, and for ids never trained the row the trained
        model gave them (a lazy table's initializer row; zeros for an explicit table,
        whose rows all exist)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.spec.num_embeddings):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise IndexError(f"table {self.spec.name!r}: id {bad} out of range "
                             f"[0, {self.spec.num_embeddings})")
        pos = np.searchsorted(self.ids, ids)
        pos_clipped = np.minimum(pos, max(self.ids.shape[0] - 1, 0))
        found = (pos < self.ids.shape[0]) & (self.ids[pos_clipped] == ids) if self.ids.size \
            else np.zeros(ids.shape, dtype=bool)
        out = torch.empty((ids.shape[0], self.spec.dim), dtype=self.spec.dtype)
        if found.any():
            out[torch.from_numpy(found)] = self.values[torch.from_numpy(pos_clipped[found])]
        if not found.all():
            missing = ids[~found]
            out[torch.from_numpy(~found)] = torch.zeros(
                (missing.shape[0], self.spec.dim), dtype=self.spec.dtype) \
                if self.spec.explicit else self.spec.initial_rows(missing)
        return out


def sort_rows(spec: TableSpec, ids: np.ndarray, values: torch.Tensor) -> SparseRows:
    order = np.argsort(ids, kind="stable")
    return SparseRows(spec, np.ascontiguousarray(ids[order]),
                      values.index_select(0, torch.from_numpy(order)))


def _table_dir(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


class SparseExportWriter:
    """Writes tables part by part under ``<directory>/sparse_tables``; :meth:`close`
    writes the manifest (the export exists only once it is there)."""

    def __init__(self, directory: str, rows_per_part: int = ROWS_PER_PART):
        self.root = os.path.join(directory, SPARSE_DIR)
        self.rows_per_part = rows_per_part
        self.tables: dict[str, dict[str, Any]] = {}
        os.makedirs(self.root, exist_ok=True)

    def add(self, spec: TableSpec, ids: np.ndarray, values: torch.Tensor) -> None:
        """Rows of ``spec``'s table (any order; one call per page, e.g. per PS)."""
        entry = self.tables.setdefault(spec.name, {"spec": spec.to_dict(), "rows": 0,
                                                   "files": []})
        os.makedirs(os.path.join(self.root, _table_dir(spec.name)), exist_ok=True)
        for start in range(0, ids.shape[0], self.rows_per_part):
            part = sort_rows(spec, ids[start:start + self.rows_per_part],
                             values[start:start + self.rows_per_part])
            rel = os.path.join(_table_dir(spec.name), f"part-{len(entry['files']):05d}.pt")
            tmp = os.path.join(self.root, rel + ".tmp")
            torch.save({"ids": torch.from_numpy(part.ids), "values": part.values.contiguous()},
                       tmp)
            os.replace(tmp, os.path.join(self.root, rel))
            entry["files"].append(rel)
            entry["rows"] += int(part.ids.shape[0])

    def declare(self, spec: TableSpec) -> None:
        """A table with no row at all still belongs in the export."""
        self.tables.setdefault(spec.name, {"spec": spec.to_dict(), "rows": 0, "files": []})

    def close(self) -> str:
        path = os.path.join(self.root, MANIFEST)
        with open(path + ".tmp", "w") as f:
            json.dump({"format": FORMAT, "tables": self.tables}, f, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)
        return path


def has_sparse_export(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, SPARSE_DIR, MANIFEST))


def read_manifest(directory: str) -> dict[str, dict[str, Any]]:
    """Per table: ``spec`` (a TableSpec), ``rows``, ``files``.

    Raises:
        ValueError: no manifest, or of an unknown format.
    """
    path = os.path.join(directory, SPARSE_DIR, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{directory}: no sparse table export ({path} is missing)") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown format {manifest.get('format')!r}")
    out = {}
    for name, entry in manifest["tables"].items():
        out[name] = {**entry, "spec": TableSpec.from_dict(entry["spec"])}
    return out


def read_tables(directory: str, names: Optional[list[str]] = None) -> dict[str, SparseRows]:
    """The sparse tables of an export (all, or ``names``), each with its ids sorted."""
    out = {}
    for name, entry in read_manifest(directory).items():
        if names is not None and name not in names:
            continue
        spec: TableSpec = entry["spec"]
        ids, values = [], []
        for rel in entry["files"]:
            part = torch.load(os.path.join(directory, SPARSE_DIR, rel), map_location="cpu",
                              weights_only=True)
            ids.append(part["ids"].numpy())
            values.append(part["values"])
        if not ids:
            out[name] = SparseRows(spec, np.empty(0, dtype=np.int64),
                                   torch.empty((0, spec.dim), dtype=spec.dtype))
            continue
        out[name] = sort_rows(spec, np.concatenate(ids), torch.cat(values))
    return out


def export_bytes(directory: str) -> int:
    """Bytes of the sparse tables on disk."""
    root = os.path.join(directory, SPARSE_DIR)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root)
               for f in files)
