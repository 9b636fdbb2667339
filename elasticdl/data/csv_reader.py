"""Line-oriented readers: CSV/TSV and plain text, over a byte-offset index of record starts.

Each file is indexed once, lazily, by streaming it in binary blocks and locating newlines with
numpy; the index is an int64 array of record start offsets (plus the end of the last record).
A read seeks to the first record of the range and reads exactly the bytes of the range, so no
file is ever loaded whole.

Conventions shared by both readers:

- a record is one line; lines end with ``\\n`` or ``\\r\\n``, and the last line may lack one;
- blank lines at the end of a file are ignored; blank lines elsewhere are records (an empty
  string for text, a row of zero fields, hence malformed, for CSV);
- a UTF-8 byte-order mark at the start of a file is skipped;
- the encoding must be ASCII-compatible (newlines are found in the raw bytes).

CSV records are lists of ``str`` fields parsed with the :mod:`csv` module. A quoted field cannot
contain a newline (a record never spans lines); such a record is reported as malformed.

Index persistence: with a cache directory (``index_cache_dir``, else the ``ELASTICDL_INDEX_CACHE``
environment variable, which the master sets to ``<job_dir>/data_index``) each file's index is
saved there as ``.npy``, keyed by the file's absolute path, size and modification time, and
memory-mapped back instead of re-reading the file: a restarted master serves at once.

Object storage (``s3://...``, :mod:`elasticdl.data.fs`): indexing streams the object once in
blocks; a read is one ranged GET of exactly its records' bytes. The cache key is the URL, size
and ETag; the cache directory may itself be a URL (``ELASTICDL_INDEX_CACHE=s3://b/cache``), so
that pods that share no disk share the master's index instead of each streaming the object.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import io
import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from elasticdl.data import fs
from elasticdl.data.api import DataError, FileDataReader, MalformedRecordError

logger = logging.getLogger(__name__)

__all__ = ["BLOCK_SIZE", "CSVDataReader", "LineIndex", "TextDataReader", "build_line_index"]

BLOCK_SIZE = 4 << 20
"""Bytes read per block when indexing a file."""

INDEX_CACHE_ENV = "ELASTICDL_INDEX_CACHE"
"""Environment variable naming the directory where line indexes are kept (see module docs)."""

_NEWLINE = ord("\n")
_UTF8_BOM = codecs.BOM_UTF8


def build_line_index(path: str, block_size: int = BLOCK_SIZE, skip_bom: bool = True) -> np.ndarray:
    """Index the lines of ``path``, reading it in blocks of ``block_size`` bytes.

    Returns:
        An int64 array of ``n + 1`` byte offsets for the ``n`` lines of the file: line ``i``
        spans ``[offsets[i], offsets[i + 1])``, newline included. Trailing blank lines are not
        counted; a leading UTF-8 byte-order mark is skipped when ``skip_bom`` is true.

    Raises:
        DataError: the file cannot be read.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parts: list[np.ndarray] = []
    buf = bytearray(block_size)
    size = 0
    try:
        with (fs.open_input(path) if fs.is_url(path) else open(path, "rb", buffering=0)) as f:
            while n := f.readinto(buf):
                block = np.frombuffer(buf, dtype=np.uint8, count=n)
                ends = np.flatnonzero(block == _NEWLINE)
                if ends.size:
                    parts.append(ends.astype(np.int64, copy=False) + (size + 1))
                del block
                size += n
        first = 0
        if skip_bom and size >= len(_UTF8_BOM):
            first = len(_UTF8_BOM) if _read_span(path, 0, len(_UTF8_BOM)) == _UTF8_BOM else 0
    except OSError as err:
        raise DataError(f"{path}: cannot read: {err}") from err
    pieces = [np.array([first], dtype=np.int64), *parts]
    if size > first and (not parts or parts[-1][-1] != size):
        pieces.append(np.array([size], dtype=np.int64))  # a last line without newline
    offsets = np.concatenate(pieces)
    count = len(offsets) - 1
    while count > 0 and offsets[count] - offsets[count - 1] <= 2:
        if _read_span(path, int(offsets[count - 1]), int(offsets[count])).strip(b"\r\n"):
            break
        count -= 1
    return offsets[: count + 1]


def _save_index(cached: str, offsets: np.ndarray) -> None:
    """Keep an index for the next reader (atomic; a cache: failing to write it only warns)."""
    if fs.is_url(cached):
        out = io.BytesIO()
        np.save(out, offsets)
        try:
            fs.write_bytes(cached, out.getvalue())
        except DataError as err:
            logger.warning("cannot keep the line index in %s: %s", fs.redact(cached), err)
        return
    tmp = f"{cached}.{os.getpid()}.tmp.npy"
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        np.save(tmp, offsets)
        os.replace(tmp, cached)
    except OSError as err:
        logger.warning("cannot keep the line index in %s: %s", cached, err)


def _read_span(path: str, begin: int, stop: int) -> bytes:
    """Return bytes ``[begin, stop)`` of ``path``, raising DataError if they are not all there."""
    if fs.is_url(path):
        return fs.read_range(path, begin, stop)    # one ranged GET
    try:
        with open(path, "rb") as f:
            f.seek(begin)
            data = f.read(stop - begin)
    except OSError as err:
        raise DataError(f"{path}: cannot read: {err}") from err
    if len(data) != stop - begin:
        raise DataError(f"{path}: file is shorter than when it was indexed")
    return data


@dataclass(frozen=True)
class LineIndex:
    """Byte-offset index of the records of one file."""

    offsets: np.ndarray
    """int64 offsets: record ``i`` spans ``[offsets[i], offsets[i + 1])``."""
    header: tuple[str, ...] | None = None
    """CSV header fields, when the file has a header line (not counted as a record)."""
    num_fields: int = 0
    """Fields every CSV record of the file must have."""

    @property
    def count(self) -> int:
        """Number of records."""
        return len(self.offsets) - 1


class _LineFileReader(FileDataReader[LineIndex]):
    """Shared machinery: lazy per-file line index and range reads of decoded lines."""

    def __init__(
        self,
        files: Sequence[str],
        *,
        encoding: str = "utf-8",
        block_size: int = BLOCK_SIZE,
        index_cache_dir: str | None = None,
    ) -> None:
        self._index_cache_dir = index_cache_dir
        try:
            codec = codecs.lookup(encoding).name
        except LookupError:
            raise ValueError(f"unknown encoding {encoding!r}") from None
        if "\r\n,\t".encode(codec) != b"\r\n,\t":
            raise ValueError(f"encoding {encoding!r} is not ASCII-compatible")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        super().__init__(files)
        # utf-8-sig would strip a BOM at the start of every chunk; the index skips the file's one.
        self._encoding = "utf-8" if codec == "utf-8-sig" else codec
        self._block_size = block_size

    @property
    def encoding(self) -> str:
        """Codec used to decode the files."""
        return self._encoding

    def _index_cache(self, path: str) -> str | None:
        """Where ``path``'s index is kept (None: no cache directory)."""
        directory = self._index_cache_dir or os.environ.get(INDEX_CACHE_ENV, "")
        if not directory:
            return None
        if fs.is_url(path):    # keyed by URL, size and ETag: a rewritten object is indexed anew
            obj = fs.info(path)
            key = f"{path}|{obj.size}|{obj.version}|{self._encoding == 'utf-8'}"
            return fs.join(directory, hashlib.sha1(key.encode()).hexdigest() + ".npy")
        try:
            st = os.stat(path)
        except OSError as err:
            raise DataError(f"{path}: cannot read: {err}") from err
        key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{self._encoding == 'utf-8'}"
        return os.path.join(directory, hashlib.sha1(key.encode()).hexdigest() + ".npy")

    def _index_lines(self, path: str) -> np.ndarray:
        began = time.perf_counter()
        cached = self._index_cache(path)
        if cached is not None and fs.is_url(cached):
            shared = _load_remote_index(cached)
            if shared is not None:
                return shared
        elif cached is not None and os.path.exists(cached):
            try:
                offsets = np.load(cached, mmap_mode="r")
                logger.debug("index of %s reused from %s", path, cached)
                return offsets
            except (OSError, ValueError) as err:
                logger.warning("index cache %s unreadable (%s): indexing %s again", cached, err,
                               path)
        offsets = build_line_index(path, self._block_size, skip_bom=self._encoding == "utf-8")
        if cached is not None:
            _save_index(cached, offsets)
        # an object streamed whole is worth a line (a worker does it only when its tasks
        # carry no span: elasticdl.master.servicer)
        logger.log(
            logging.INFO if fs.is_url(path) else logging.DEBUG,
            "indexed %s: %d lines, %d bytes in %.3fs",
            fs.redact(path) if fs.is_url(path) else path,
            len(offsets) - 1,
            int(offsets[-1]),
            time.perf_counter() - began,
        )
        return offsets

    def _count(self, meta: LineIndex) -> int:
        return meta.count

    def _read_lines(self, path: str, offsets: np.ndarray, start: int, end: int) -> list[str]:
        """Decode records ``[start, end)`` of ``path`` into lines without their line ending."""
        data = _read_span(path, int(offsets[start]), int(offsets[end]))
        return self._decode_lines(path, data, start, end - start)

    def _decode_lines(self, path: str, data: bytes, start: int, count: int,
                      exact: bool = False) -> list[str]:
        """The ``count`` lines of ``data`` (records from ``start``), without line endings;
        ``exact``: ``data`` must hold exactly those lines (a span from another process's
        index: anything else means the file changed)."""
        try:
            text = data.decode(self._encoding)
        except UnicodeDecodeError as err:
            raise MalformedRecordError(
                path, start + data.count(b"\n", 0, err.start),
                f"cannot decode as {self._encoding}: {err.reason}") from err
        lines = text.split("\n")
        if len(lines) < count or (exact and not (
                len(lines) == count + 1 and lines[-1] == "" or len(lines) == count)):
            raise DataError(f"{path}: file changed since it was indexed")
        del lines[count:]
        return [line[:-1] if line.endswith("\r") else line for line in lines]

    def span(self, name: str, start: int, end: int) -> tuple[int, int, int] | None:
        """``(first byte, end byte, fields per CSV record)`` of records ``[start, end)`` of
        file ``name`` from this reader's index (the master's), for a worker to read them
        without an index of its own (:meth:`read_span`); None when the file cannot be
        indexed here (a worker then indexes it itself)."""
        try:
            meta = self._metadata(name)
        except DataError:
            return None
        if not 0 <= start <= end <= meta.count:
            return None
        return int(meta.offsets[start]), int(meta.offsets[end]), meta.num_fields

    def read_span(self, name: str, start: int, end: int,
                  span: tuple[int, int, int]) -> list[Any]:
        """Records ``[start, end)`` of file ``name`` whose bytes are ``span`` (from
        :meth:`span` of the master's reader): one read of exactly those bytes, no index
        (on object storage: one ranged GET, where indexing streams the whole object).

        Raises:
            DataError: the bytes do not hold exactly those records (the file changed), or
                cannot be read.
            MalformedRecordError: a record does not parse.
        """
        path = self._resolve(name)
        if path in self._meta:          # indexed here anyway
            return self.read(name, start, end)
        begin, stop, fields = (int(x) for x in span)
        if not (0 <= begin <= stop and 0 <= start <= end and fields >= 0):
            raise ValueError(f"{path}: invalid span {span} for records [{start}, {end})")
        if start == end:
            return []
        return self._remote(path, f"read records {start}-{end}", lambda: self._span_records(
            path, self._decode_lines(path, _read_span(path, begin, stop), start, end - start,
                                     exact=True), start, fields))

    def _span_records(self, path: str, lines: list[str], start: int, fields: int) -> list[Any]:
        return lines


def _load_remote_index(cached: str) -> np.ndarray | None:
    """An index kept in object storage, or None when there is none yet (or it is unreadable)."""
    try:
        data = fs.read_bytes(cached)
    except DataError:
        return None
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (OSError, ValueError) as err:
        logger.warning("index cache %s unreadable (%s): indexing again", fs.redact(cached), err)
        return None


class TextDataReader(_LineFileReader):
    """Reads text files where each line is one record (a ``str`` without its line ending)."""

    def _scan(self, path: str) -> LineIndex:
        return LineIndex(self._index_lines(path))

    def _read_range(self, path: str, meta: LineIndex, start: int, end: int) -> list[str]:
        return self._read_lines(path, meta.offsets, start, end)


class CSVDataReader(_LineFileReader):
    """Reads CSV/TSV files; each record is the list of ``str`` fields of one line.

    Args:
        files: the data files.
        sep: field delimiter (one character); default ``"\\t"`` for ``.tsv`` files, else ``","``.
        header: the first line of each file is a header, not a record. All files must then
            have the same header.
        encoding: an ASCII-compatible codec.
        block_size: bytes read per block when indexing.
        index_cache_dir: keep each file's index here (see module docs).

    Every record of a file must have as many fields as the header or, without header, as the
    first record of that file; otherwise reading it raises :class:`MalformedRecordError`.
    """

    def __init__(
        self,
        files: Sequence[str],
        *,
        sep: str | None = None,
        header: bool = False,
        encoding: str = "utf-8",
        block_size: int = BLOCK_SIZE,
        index_cache_dir: str | None = None,
    ) -> None:
        if sep is not None and (len(sep) != 1 or sep in "\r\n"):
            raise ValueError(f"sep must be one character other than a newline, got {sep!r}")
        super().__init__(files, encoding=encoding, block_size=block_size,
                         index_cache_dir=index_cache_dir)
        self._sep = sep
        self._header = header
        self._columns: tuple[str, ...] | None = None

    def delimiter(self, name: str) -> str:
        """Field delimiter used for file ``name``."""
        if self._sep is not None:
            return self._sep
        return "\t" if name.lower().endswith(".tsv") else ","

    @property
    def columns(self) -> list[str] | None:
        """Header fields (of the first file with a non-blank first line); None without header.

        Raises:
            DataError: a file cannot be read.
            MalformedRecordError: the header line cannot be parsed (record index -1).
        """
        if not self._header:
            return None
        if self._columns is None:
            self._columns = self._first_header()
        return list(self._columns)

    def _first_header(self) -> tuple[str, ...]:
        for path in self._files:
            try:
                with fs.open_input(path, 1 << 16) if fs.is_url(path) else open(path, "rb") as f:
                    line = f.readline()
            except OSError as err:
                raise DataError(f"{path}: cannot read: {err}") from err
            if self._encoding == "utf-8" and line.startswith(_UTF8_BOM):
                line = line[len(_UTF8_BOM) :]
            if line.strip(b"\r\n"):
                offsets = np.array([0, len(line)], dtype=np.int64)
                return tuple(self._parse_header(path, offsets))
        return ()

    def _parse_header(self, path: str, offsets: np.ndarray) -> list[str]:
        try:
            return self._parse(path, offsets, 0, 1, expected=None)[0]
        except MalformedRecordError as err:
            raise MalformedRecordError(path, -1, f"bad header: {err.reason}") from err

    def _scan(self, path: str) -> LineIndex:
        offsets = self._index_lines(path)
        header: tuple[str, ...] | None = None
        if self._header and len(offsets) > 1:
            header = tuple(self._parse_header(path, offsets))
            expected = self.columns
            if list(header) != expected:
                raise DataError(
                    f"{path}: header {list(header)} differs from the dataset's header {expected}"
                )
            offsets = offsets[1:]
        if header is not None:
            num_fields = len(header)
        elif len(offsets) > 1:
            num_fields = len(self._parse(path, offsets, 0, 1, expected=None)[0])
        else:
            num_fields = 0
        return LineIndex(offsets, header, num_fields)

    def _read_range(self, path: str, meta: LineIndex, start: int, end: int) -> list[list[str]]:
        return self._parse(path, meta.offsets, start, end, expected=meta.num_fields)

    def _span_records(self, path: str, lines: list[str], start: int, fields: int) -> list[Any]:
        return self._parse_lines(path, lines, start, fields or None)

    def _parse(
        self, path: str, offsets: np.ndarray, start: int, end: int, expected: int | None
    ) -> list[list[str]]:
        """Parse records ``[start, end)``, checking each has ``expected`` fields."""
        return self._parse_lines(path, self._read_lines(path, offsets, start, end), start,
                                 expected)

    def _parse_lines(self, path: str, lines: list[str], start: int, expected: int | None
                     ) -> list[list[str]]:
        # The sentinel line makes an unterminated quote in the last line detectable the same way
        # as anywhere else: the reader then consumes more than one line for that row.
        reader = csv.reader(itertools.chain(lines, ("",)), delimiter=self.delimiter(path))
        rows: list[list[str]] = []
        index = start
        try:
            for i in range(len(lines)):
                index = start + i
                row = next(reader)
                if reader.line_num != i + 1:
                    raise MalformedRecordError(
                        path, index, "unterminated quoted field (a record cannot span lines)"
                    )
                if expected is not None and len(row) != expected:
                    raise MalformedRecordError(
                        path, index, f"expected {expected} fields, got {len(row)}"
                    )
                rows.append(row)
        except csv.Error as err:
            raise MalformedRecordError(path, index, f"csv error: {err}") from err
        return rows
