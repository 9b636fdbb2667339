"""Parquet reader: records are dicts ``{column: python value}``, read by row group via pyarrow.

pyarrow is imported only when a file is first scanned or read, so importing this module (as the
registry does) costs nothing where Parquet is not used. Record counts come from the file footer;
a read decodes only the row groups overlapping the requested range. From object storage
(:mod:`elasticdl.data.fs`) a read fetches the footer and those row groups' column chunks by
range, never the whole object. Decoded row groups are kept (up to
:data:`ROW_GROUP_CACHE_BYTES`), so the tasks within one row group read it once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from elasticdl.data import fs
from elasticdl.data.api import DataError, FileDataReader

logger = logging.getLogger(__name__)

__all__ = ["ParquetDataReader"]

ROW_GROUP_CACHE_BYTES = 64 << 20
"""Decoded row groups a reader keeps (least recently used evicted): the tasks in one row
group cost one read of it, not one each."""


def _pyarrow(path: str) -> tuple[ModuleType, ModuleType]:
    """Return ``(pyarrow, pyarrow.parquet)``, or raise DataError naming ``path`` if missing."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as err:
        raise DataError(
            f"{path}: reading Parquet requires pyarrow, which is not installed "
            "(pip install pyarrow)"
        ) from err
    return pyarrow, pyarrow.parquet


class ParquetDataReader(FileDataReader[np.ndarray]):
    """Reads Parquet files; one shard per file.

    Args:
        files: the data files.
        columns: columns to read (all when None); each must exist in every file.
    """

    def __init__(self, files: Sequence[str], *, columns: Sequence[str] | None = None) -> None:
        super().__init__(files)
        if columns is not None and (isinstance(columns, str) or not columns):
            raise ValueError(f"columns must be a non-empty sequence of names, got {columns!r}")
        self._columns = list(columns) if columns is not None else None

    @property
    def columns(self) -> list[str] | None:
        """Columns read, or None for all."""
        return None if self._columns is None else list(self._columns)

    def _scan(self, path: str) -> np.ndarray:
        """Row offsets of the file's row groups: group ``g`` holds rows
        ``[offsets[g], offsets[g + 1])``."""
        pa, pq = _pyarrow(path)
        try:
            if fs.is_url(path):    # the footer only: a few ranged reads at the object's end
                with fs.open_input(path, exact=True) as f:
                    metadata = pq.read_metadata(f)
            else:
                metadata = pq.read_metadata(path)
        except (OSError, pa.ArrowException) as err:
            raise DataError(f"{path}: cannot read as Parquet: {err}") from err
        if self._columns is not None:
            names = set(metadata.schema.to_arrow_schema().names)
            missing = [c for c in self._columns if c not in names]
            if missing:
                raise DataError(f"{path}: no column(s) {missing}; the file has {sorted(names)}")
        sizes = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        if offsets[-1] != metadata.num_rows:
            raise DataError(
                f"{path}: row groups hold {offsets[-1]} rows, footer says {metadata.num_rows}"
            )
        return offsets

    def _count(self, meta: np.ndarray) -> int:
        return int(meta[-1])

    def _init_state(self) -> None:
        super()._init_state()
        self._groups: OrderedDict[tuple[str, int], Any] = OrderedDict()
        self._groups_bytes = 0
        self._groups_lock = threading.Lock()

    def _transient_attributes(self) -> tuple[str, ...]:
        return (*super()._transient_attributes(), "_groups", "_groups_bytes", "_groups_lock")

    def _read_range(self, path: str, meta: np.ndarray, start: int, end: int) -> list[Any]:
        pa, pq = _pyarrow(path)
        first = int(np.searchsorted(meta, start, side="right")) - 1
        last = int(np.searchsorted(meta, end, side="left"))
        groups = {g: self._cached_group(path, g) for g in range(first, last)}
        missing = [g for g, table in groups.items() if table is None]
        try:
            # an object: the footer and the column chunks of the missing row groups, by range
            if missing:
                with contextlib.ExitStack() as stack:
                    source = stack.enter_context(fs.open_input(path, exact=True)) \
                        if fs.is_url(path) else path
                    parquet = stack.enter_context(pq.ParquetFile(source))
                    for g in missing:
                        groups[g] = parquet.read_row_group(g, columns=self._columns,
                                                           use_threads=False)
                        self._keep_group(path, g, groups[g])
            table = pa.concat_tables([groups[g] for g in range(first, last)])
        except (OSError, pa.ArrowException) as err:
            raise DataError(f"{path}: cannot read as Parquet: {err}") from err
        offset = start - int(meta[first])
        if table.num_rows < offset + (end - start):
            raise DataError(f"{path}: file changed since it was indexed")
        return table.slice(offset, end - start).to_pylist()

    def _cached_group(self, path: str, group: int) -> Any:
        with self._groups_lock:
            table = self._groups.get((path, group))
            if table is not None:
                self._groups.move_to_end((path, group))
            return table

    def _keep_group(self, path: str, group: int, table: Any) -> None:
        """Keep a decoded row group for the next tasks in it (tasks are usually smaller than
        row groups, and a worker's tasks of a file come in order), within
        :data:`ROW_GROUP_CACHE_BYTES`."""
        size = int(table.nbytes)
        if size > ROW_GROUP_CACHE_BYTES:
            return
        with self._groups_lock:
            if (path, group) in self._groups:
                return
            self._groups[(path, group)] = table
            self._groups_bytes += size
            while self._groups_bytes > ROW_GROUP_CACHE_BYTES:
                _, evicted = self._groups.popitem(last=False)
                self._groups_bytes -= int(evicted.nbytes)
