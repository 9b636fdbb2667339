"""Arrow reader: ``.arrow`` files and Hugging Face ``datasets`` saved with ``save_to_disk``.

``Dataset.save_to_disk(DIR)`` writes ``DIR/state.json``, ``DIR/dataset_info.json`` and the
rows in ``DIR/data-0000i-of-0000n.arrow`` (Arrow IPC stream format). ``--training_data=DIR``
reads them in the order ``state.json`` lists (the dataset's row order) without importing
``datasets``: records are dicts ``{column: python value}`` as in the Parquet reader, one
shard per file. A ``DatasetDict`` directory (``dataset_dict.json``) holds one such directory
per split: name the split's directory (``DIR/train``).

Files are memory-mapped; a read decodes only the record batches overlapping the range.
pyarrow is imported when a file is first scanned or read.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from elasticdl.data import fs
from elasticdl.data.api import DataError, FileDataReader

logger = logging.getLogger(__name__)

__all__ = ["ArrowDataReader", "hf_dataset_files", "is_hf_dataset_dir"]

HF_STATE = "state.json"
HF_INFO = "dataset_info.json"
HF_DICT = "dataset_dict.json"


def is_hf_dataset_dir(path: str) -> bool:
    """Whether ``path`` is a directory written by ``save_to_disk`` (a Dataset or a
    DatasetDict)."""
    if fs.is_url(path):    # one listing of the prefix (none for an object or nothing there)
        names = {name for name, is_dir in fs.list_entries(path) if not is_dir}
        return HF_DICT in names or (HF_STATE in names and HF_INFO in names)
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, HF_DICT))
        or (os.path.isfile(os.path.join(path, HF_STATE))
            and os.path.isfile(os.path.join(path, HF_INFO))))


def hf_dataset_files(path: str) -> list[str]:
    """The ``.arrow`` files of a ``save_to_disk`` directory, in the dataset's order.

    Raises:
        DataError: a DatasetDict directory (its splits are named), or a ``state.json``
            that lists no data file or a missing one.
    """
    path = fs.normalize(path)
    dict_file = fs.join(path, HF_DICT)
    if fs.isfile(dict_file):
        try:
            splits = json.loads(fs.read_bytes(dict_file)).get("splits", [])
        except ValueError as err:
            raise DataError(f"{dict_file}: unreadable: {err}") from err
        first = str(splits[0]) if splits else "train"
        raise DataError(f"{path} is a Hugging Face DatasetDict (splits {splits}); name one "
                        f"split's directory, e.g. {fs.join(path, first)}")
    state_file = fs.join(path, HF_STATE)
    try:
        state = json.loads(fs.read_bytes(state_file))
    except ValueError as err:
        raise DataError(f"{state_file}: unreadable: {err}") from err
    if state.get("_indices_data_files"):
        raise DataError(f"{path}: the saved dataset has an indices mapping; save it after "
                        "flatten_indices()")
    names = [d.get("filename") for d in state.get("_data_files", [])]
    if not names or not all(isinstance(n, str) and n for n in names):
        raise DataError(f"{state_file}: lists no data files (_data_files)")
    files = [fs.join(path, n) for n in names]
    missing = [f for f in files if not fs.isfile(f)]
    if missing:
        raise DataError(f"{path}: data file(s) listed in {HF_STATE} missing: {missing[:3]}")
    return files


def _pyarrow(path: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401 - the submodule is used through pyarrow.ipc
    except ImportError as err:
        raise DataError(f"{path}: reading Arrow files requires pyarrow (pip install pyarrow)"
                        ) from err
    return pyarrow


def _open(pa: Any, path: str) -> Any:
    """A reader of the file (IPC file format or stream format) over a memory map; over an
    object, over a file that reads it by range (the stream format reads the batches before
    the last one wanted)."""
    if fs.is_url(path):
        try:
            return pa.ipc.open_file(fs.open_input(path))
        except pa.ArrowInvalid:
            return pa.ipc.open_stream(fs.open_input(path))
    source = pa.memory_map(path, "r")
    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        source = pa.memory_map(path, "r")
        return pa.ipc.open_stream(source)


def _batches(reader: Any) -> Any:
    if hasattr(reader, "num_record_batches"):   # file format: random access
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)


class ArrowDataReader(FileDataReader[np.ndarray]):
    """Reads Arrow IPC files (file or stream format); one shard per file. A file's
    order in ``files`` is kept (a save_to_disk dataset's row order), not sorted."""

    def __init__(self, files: Sequence[str], *, columns: Sequence[str] | None = None) -> None:
        super().__init__(files)
        self._files = tuple(fs.normalize(f) for f in files)   # the given order
        self._columns = list(columns) if columns is not None else None

    def _scan(self, path: str) -> np.ndarray:
        """Row offsets of the file's record batches."""
        pa = _pyarrow(path)
        try:
            reader = _open(pa, path)
            names = set(reader.schema.names)
            sizes = [b.num_rows for b in _batches(reader)]
        except (OSError, pa.ArrowException) as err:
            raise DataError(f"{path}: cannot read as Arrow: {err}") from err
        if self._columns is not None:
            missing = [c for c in self._columns if c not in names]
            if missing:
                raise DataError(f"{path}: no column(s) {missing}; the file has {sorted(names)}")
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        return offsets

    def _count(self, meta: np.ndarray) -> int:
        return int(meta[-1])

    def _read_range(self, path: str, meta: np.ndarray, start: int, end: int) -> list[Any]:
        pa = _pyarrow(path)
        first = int(np.searchsorted(meta, start, side="right")) - 1
        last = int(np.searchsorted(meta, end, side="left"))
        try:
            reader = _open(pa, path)
            wanted = []
            for i, batch in enumerate(_batches(reader)):
                if i >= last:
                    break
                if i >= first:
                    wanted.append(batch)
            table = pa.Table.from_batches(wanted, schema=reader.schema)
        except (OSError, pa.ArrowException) as err:
            raise DataError(f"{path}: cannot read as Arrow: {err}") from err
        offset = start - int(meta[first])
        if table.num_rows < offset + (end - start):
            raise DataError(f"{path}: file changed since it was indexed")
        table = table.slice(offset, end - start)
        if self._columns is not None:
            table = table.select(self._columns)
        return table.to_pylist()
