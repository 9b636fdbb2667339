"""NumPy reader: ``.npy`` files (records are rows) or ``.npz`` files (records are dicts of rows).

Record counts come from the array headers, without reading array data. ``.npy`` files are
memory-mapped on each read, so a read touches only the pages of its rows and the returned rows
are read-only views of the mapping. ``.npz`` members cannot be mapped (they may be compressed),
so a file's arrays are loaded on its first read and kept in a small LRU cache.

From object storage (:mod:`elasticdl.data.fs`): a ``.npy`` read is its header plus one ranged
read of its rows; an ``.npz`` is fetched whole by each process that reads it (then cached).
"""

from __future__ import annotations

import io
import logging
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from elasticdl.data import fs
from elasticdl.data.api import DataError, FileDataReader

logger = logging.getLogger(__name__)

__all__ = ["NumPyDataReader"]

NPZ_CACHE_FILES = 2
"""How many ``.npz`` files a reader keeps loaded by default."""

_Arrays = dict[str, np.ndarray]


def _npy_header(path: str) -> tuple[tuple[int, ...], np.dtype, int]:
    """``(shape, dtype, data offset)`` of a ``.npy`` object, from its header (one small
    ranged read); C-order arrays of plain dtypes only (their rows are contiguous bytes)."""
    try:
        with fs.open_input(path, 1 << 16) as fp:
            version = np.lib.format.read_magic(fp)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
            else:
                raise ValueError(f"unsupported .npy format version {version}")
            offset = fp.tell()
    except ValueError as err:
        raise DataError(f"{fs.redact(path)}: cannot read as .npy: {err}") from err
    if not shape:
        raise DataError(f"{path}: a .npy data file must hold an array of at least one dimension")
    if dtype.hasobject or (fortran and len(shape) > 1):
        raise DataError(f"{fs.redact(path)}: a .npy object read by range must hold a C-order "
                        "array of a plain dtype (no objects, not Fortran order)")
    return tuple(shape), dtype, offset


def _npy_remote_rows(path: str, count: int, start: int, end: int) -> list[Any]:
    """Rows ``[start, end)`` of a ``.npy`` object: its header, then one ranged read."""
    shape, dtype, offset = _npy_header(path)
    if shape[0] != count:
        raise DataError(f"{fs.redact(path)}: file changed since it was indexed")
    row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
    data = fs.read_range(path, offset + start * row, offset + end * row)
    array = np.frombuffer(data, dtype=dtype).reshape((end - start, *shape[1:]))
    return list(array)


def _npy_count(path: str) -> int:
    if fs.is_url(path):
        return _npy_header(path)[0][0]
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: cannot read as .npy: {err}") from err
    if not isinstance(array, np.ndarray) or array.ndim == 0:
        raise DataError(f"{path}: a .npy data file must hold an array of at least one dimension")
    return int(array.shape[0])


def _member_shape(archive: zipfile.ZipFile, member: str) -> tuple[int, ...]:
    """Shape of one ``.npy`` member of an ``.npz``, read from its header only."""
    with archive.open(member) as fp:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, _, _ = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, _, _ = np.lib.format.read_array_header_2_0(fp)
        else:  # rare (3.0: non-latin-1 field names); load the array to learn its shape
            fp.seek(0)
            shape = np.lib.format.read_array(fp, allow_pickle=False).shape
    return tuple(shape)


def _npz_count(path: str) -> int:
    try:
        with (fs.open_input(path, 1 << 20) if fs.is_url(path) else open(path, "rb")) as f, \
                zipfile.ZipFile(f) as archive:
            shapes = {
                member.removesuffix(".npy"): _member_shape(archive, member)
                for member in archive.namelist()
                if member.endswith(".npy")
            }
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise DataError(f"{path}: cannot read as .npz: {err}") from err
    if not shapes:
        raise DataError(f"{path}: .npz file holds no arrays")
    scalars = sorted(name for name, shape in shapes.items() if not shape)
    if scalars:
        raise DataError(f"{path}: arrays {scalars} have no first dimension")
    firsts = {name: shape[0] for name, shape in shapes.items()}
    if len(set(firsts.values())) != 1:
        listing = ", ".join(f"{name}: {n}" for name, n in sorted(firsts.items()))
        raise DataError(f"{path}: arrays do not share their first dimension ({listing})")
    return next(iter(firsts.values()))


class NumPyDataReader(FileDataReader[int]):
    """Reads ``.npy`` or ``.npz`` files (all files of a dataset must be of the same kind).

    Records of a ``.npy`` file are the rows of its array (``array[i]``); records of an ``.npz``
    file are dicts ``{array_name: array[i]}`` and all its arrays must share their first
    dimension.

    Args:
        files: the data files.
        npz_cache_files: how many ``.npz`` files to keep loaded (least recently used evicted).
    """

    def __init__(self, files: Sequence[str], *, npz_cache_files: int = NPZ_CACHE_FILES) -> None:
        super().__init__(files)
        kinds = {path.lower().rsplit(".", 1)[-1] for path in self._files}
        if not kinds <= {"npy", "npz"}:
            raise DataError(f"{self._files[0]}: NumPy data files must end in .npy or .npz")
        if len(kinds) > 1:
            raise DataError(
                f"{self._files[0]}: a NumPy dataset mixes .npy and .npz files; use one kind"
            )
        if npz_cache_files < 1:
            raise ValueError(f"npz_cache_files must be positive, got {npz_cache_files}")
        self._is_npz = kinds == {"npz"}
        self._npz_cache_files = npz_cache_files

    def _init_state(self) -> None:
        super()._init_state()
        self._npz_cache: OrderedDict[str, _Arrays] = OrderedDict()
        self._npz_lock = threading.Lock()

    def _transient_attributes(self) -> tuple[str, ...]:
        return (*super()._transient_attributes(), "_npz_cache", "_npz_lock")

    def _scan(self, path: str) -> int:
        return _npz_count(path) if self._is_npz else _npy_count(path)

    def _count(self, meta: int) -> int:
        return meta

    def _read_range(self, path: str, meta: int, start: int, end: int) -> list[Any]:
        if not self._is_npz and fs.is_url(path):
            return _npy_remote_rows(path, meta, start, end)
        if not self._is_npz:
            try:
                array = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as err:
                raise DataError(f"{path}: cannot read as .npy: {err}") from err
            if array.shape[:1] != (meta,):
                raise DataError(f"{path}: file changed since it was indexed")
            return list(array[start:end])
        arrays = self._npz_arrays(path, meta)
        columns = {name: array[start:end] for name, array in arrays.items()}
        return [{name: rows[i] for name, rows in columns.items()} for i in range(end - start)]

    def _npz_arrays(self, path: str, count: int) -> _Arrays:
        """Arrays of an ``.npz`` file, loaded on first use and cached (LRU)."""
        with self._npz_lock:
            arrays = self._npz_cache.get(path)
            if arrays is not None:
                self._npz_cache.move_to_end(path)
                return arrays
            try:
                # an object is fetched whole (members may be compressed): prefer .npy or Parquet
                source = io.BytesIO(fs.read_bytes(path)) if fs.is_url(path) else path
                with np.load(source, allow_pickle=False) as npz:
                    arrays = {name: npz[name] for name in npz.files}
            except (OSError, ValueError, zipfile.BadZipFile) as err:
                raise DataError(f"{path}: cannot read as .npz: {err}") from err
            if any(array.shape[:1] != (count,) for array in arrays.values()):
                raise DataError(f"{path}: file changed since it was indexed")
            self._npz_cache[path] = arrays
            while len(self._npz_cache) > self._npz_cache_files:
                evicted, _ = self._npz_cache.popitem(last=False)
                logger.debug("evicted %s from the .npz cache", evicted)
            return arrays
