"""Data reader contract: shards, errors and the reader ABCs.

The master turns the shards of a reader into tasks; a worker reads the records of a task with
``reader.read(shard_name, start, end)``. Readers never import torch (the master imports this
package), and they are cheap to construct: every process builds its own reader from the dataset
path, and per-file metadata (record counts, byte-offset indexes) is computed lazily on first use.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

from elasticdl.data.errors import DataError, MalformedRecordError

logger = logging.getLogger(__name__)

__all__ = ["DataError", "DataReader", "FileDataReader", "MalformedRecordError", "Shard"]


class Shard(NamedTuple):
    """A contiguous range of records of one data file."""

    name: str
    """Absolute path (or URL) of the data file."""
    start: int
    """Index of the first record in the file (0-based)."""
    count: int  # type: ignore[assignment]  # shadows tuple.count; the name is the contract
    """Number of records."""


class DataReader(ABC):
    """Reads the records of a dataset by shard.

    Implementations must be safe to use from several threads, and each process creates its own
    instance (file handles are not kept between calls).
    """

    @abstractmethod
    def create_shards(self) -> list[Shard]:
        """Return the shards of the dataset: one per data file, covering all its records.

        Shards come in sorted file order; files without any record produce no shard.

        Raises:
            DataError: a file cannot be read or is inconsistent.
        """

    @abstractmethod
    def read(self, name: str, start: int, end: int) -> list[Any]:
        """Return records ``[start, end)`` of the shard file ``name``.

        Raises:
            ValueError: ``start < 0``, ``start > end`` or ``end`` beyond the file's records.
            DataError: ``name`` is not a file of this dataset or cannot be read.
            MalformedRecordError: a record in the range cannot be parsed.
        """

    def num_records(self) -> int:
        """Total number of records over all shards."""
        return sum(shard.count for shard in self.create_shards())


M = TypeVar("M")
T = TypeVar("T")


class FileDataReader(DataReader, Generic[M]):
    """Base for readers whose shards are whole files, with lazily cached per-file metadata.

    Subclasses implement :meth:`_scan` (compute the metadata of one file, e.g. its record count
    or a byte-offset index), :meth:`_count` (records in that metadata) and :meth:`_read_range`.
    Metadata is computed at most once per file, under a per-file lock, so concurrent readers of
    different files do not wait for each other. Pickling drops the caches and locks.
    """

    def __init__(self, files: Sequence[str]) -> None:
        if isinstance(files, str):
            raise TypeError("files must be a sequence of paths, not a single string")
        if not files:
            raise DataError("no data files given")
        from elasticdl.data.fs import normalize

        self._files: tuple[str, ...] = tuple(sorted({normalize(f) for f in files}))
        self._init_state()

    def _init_state(self) -> None:
        """(Re)create the transient state: caches and locks."""
        self._meta: dict[str, M] = {}
        self._locks: dict[str, threading.Lock] = {f: threading.Lock() for f in self._files}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in self._transient_attributes():
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_state()

    def _transient_attributes(self) -> tuple[str, ...]:
        """Attributes that :meth:`_init_state` recreates and pickling leaves out."""
        return ("_meta", "_locks")

    @property
    def files(self) -> tuple[str, ...]:
        """Absolute paths of the data files, sorted."""
        return self._files

    def create_shards(self) -> list[Shard]:
        shards = []
        for path in self._files:
            count = self.count(path)
            if count:
                shards.append(Shard(path, 0, count))
            else:
                logger.info("%s holds no records; no shard created", path)
        return shards

    def count(self, name: str) -> int:
        """Number of records in file ``name``.

        Raises:
            DataError: ``name`` is not a file of this dataset or cannot be read.
        """
        return self._count(self._metadata(name))

    def read(self, name: str, start: int, end: int) -> list[Any]:
        path = self._resolve(name)
        start, end = operator.index(start), operator.index(end)
        meta = self._metadata(path)
        count = self._count(meta)
        if start < 0 or start > end or end > count:
            raise ValueError(
                f"{path}: invalid record range [{start}, {end}) for a file of {count} records"
            )
        if start == end:
            return []
        return self._remote(path, f"read records {start}-{end}",
                            lambda: self._read_range(path, meta, start, end))

    def _remote(self, path: str, what: str, op: Callable[[], T]) -> T:
        """``op()`` on a local file; on a URL, with transient errors retried
        (:func:`elasticdl.data.fs.retrying`)."""
        from elasticdl.data import fs

        if not fs.is_url(path):
            return op()
        return fs.retrying(path, what, op)

    def _resolve(self, name: str) -> str:
        from elasticdl.data.fs import normalize

        path = normalize(name)
        if path not in self._locks:
            raise DataError(f"{name}: not a file of this dataset")
        return path

    def _metadata(self, name: str) -> M:
        path = self._resolve(name)
        meta = self._meta.get(path)
        if meta is not None:
            return meta
        with self._locks[path]:
            meta = self._meta.get(path)
            if meta is None:
                if "://" not in path and not os.path.isfile(path):
                    raise DataError(f"{path}: no such data file")
                meta = self._remote(path, "index", lambda: self._scan(path))
                self._meta[path] = meta
        return meta

    @abstractmethod
    def _scan(self, path: str) -> M:
        """Compute the metadata of one file (called once per file, under its lock).

        Raises:
            DataError: the file cannot be read or is inconsistent.
        """

    @abstractmethod
    def _count(self, meta: M) -> int:
        """Number of records described by ``meta``."""

    @abstractmethod
    def _read_range(self, path: str, meta: M, start: int, end: int) -> list[Any]:
        """Read records ``[start, end)`` of ``path``; the range is already validated and
        non-empty."""
