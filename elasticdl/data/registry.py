"""Data readers by format name, chosen from file extensions; string parameters parsed here.

``create_data_reader(path, params)`` lists the data files of ``path`` (a file, or a directory
whose regular files form one dataset), picks the reader registered for their extension and
builds it from the string parameters of ``--data_reader_params``-style flags, converted here
(once, at the edge) into the reader's typed arguments. Reader modules are imported only by their
factory, and optional dependencies (pyarrow) only when a file is read.

Built-in formats: ``csv`` (.csv, .tsv), ``text`` (.txt, .text), ``numpy`` (.npy, .npz),
``parquet`` (.parquet) and ``arrow`` (.arrow; also a Hugging Face ``datasets`` directory written
by ``save_to_disk``, recognised by its ``state.json`` and ``dataset_info.json``). The parameter
``format=<name>`` overrides detection by extension.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

from elasticdl.data.api import DataError, DataReader

logger = logging.getLogger(__name__)

__all__ = [
    "ReaderFactory",
    "create_data_reader",
    "dataset_files",
    "register_data_reader",
]

ReaderFactory = Callable[[Sequence[str], Mapping[str, str]], DataReader]
"""Builds a reader from sorted absolute file paths and string parameters; raises ValueError for
an unknown or invalid parameter."""

_FACTORIES: dict[str, ReaderFactory] = {}
_EXTENSIONS: dict[str, str] = {}

FORMAT_PARAM = "format"
"""Parameter naming the format explicitly, overriding detection by extension."""

SIDECAR_SUFFIXES = (".idx", ".index", ".crc")
"""Files with these suffixes in a dataset directory are index/checksum sidecars, not data.
Hidden files (``.name``) and ``_name`` files (``_SUCCESS``, Parquet ``_metadata``) are skipped
too."""

_SEPARATOR_NAMES = {
    "\\t": "\t",
    "tab": "\t",
    "comma": ",",
    "semicolon": ";",
    "pipe": "|",
    "space": " ",
}
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def register_data_reader(name: str, factory: ReaderFactory, extensions: Iterable[str] = ()) -> None:
    """Register ``factory`` under format ``name``, for files ending in ``extensions``.

    Extensions include the dot (``".csv"``) and match case-insensitively. Registering a name or
    an extension again replaces the previous registration.
    """
    _FACTORIES[name] = factory
    for ext in extensions:
        if not ext.startswith("."):
            raise ValueError(f"extension must start with '.', got {ext!r}")
        _EXTENSIONS[ext.lower()] = name


def dataset_files(path: str) -> list[str]:
    """Absolute, sorted paths of the data files of ``path``.

    A file is its own dataset. A directory's data files are its regular files (non-recursive),
    without hidden files, ``_``-prefixed files and sidecars (:data:`SIDECAR_SUFFIXES`).

    A URL (``s3://bucket/prefix``, see :mod:`elasticdl.data.fs`) is listed the same way: one
    listing of the prefix, or one stat of an object.

    Raises:
        DataError: ``path`` does not exist, or is a directory without data files.
    """
    from elasticdl.data import fs

    if fs.is_url(path):
        return _remote_dataset_files(fs.normalize(path))
    path = fs.normalize(path)    # file:// URLs too
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise DataError(f"{path}: no such file or directory")
    files = []
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.name.startswith((".", "_")) or entry.name.endswith(SIDECAR_SUFFIXES):
                    continue
                if entry.is_file():
                    files.append(entry.path)
                else:
                    logger.debug("%s: skipping %s, not a regular file", path, entry.name)
    except OSError as err:
        raise DataError(f"{path}: cannot list directory: {err}") from err
    if not files:
        raise DataError(f"{path}: directory holds no data files")
    return sorted(files)


def _remote_dataset_files(url: str) -> list[str]:
    """The data files of an object URL (itself) or of a prefix (its objects, as for a
    directory), from one listing."""
    from elasticdl.data import fs

    files = [f.url for f in fs.list_files(url)
             if not f.url.rsplit("/", 1)[-1].startswith((".", "_"))
             and not f.url.endswith(SIDECAR_SUFFIXES)]
    if not files:
        raise DataError(f"{fs.redact(url)}: prefix holds no data files")
    return sorted(files)


def _detect_format(path: str, files: Sequence[str]) -> str:
    formats: dict[str, list[str]] = {}
    for file in files:
        ext = os.path.splitext(file)[1].lower()
        fmt = _EXTENSIONS.get(ext)
        if fmt is None:
            known = ", ".join(sorted(_EXTENSIONS))
            raise DataError(
                f"{file}: unknown data format {ext or '(no extension)'!r}; "
                f"known extensions: {known}"
            )
        formats.setdefault(fmt, []).append(os.path.basename(file))
    if len(formats) > 1:
        listing = "; ".join(f"{fmt}: {', '.join(names[:3])}" for fmt, names in formats.items())
        raise DataError(f"{path}: dataset mixes data formats ({listing})")
    return next(iter(formats))


def create_data_reader(path: str, params: Mapping[str, str] | None = None) -> DataReader:
    """Create the reader for the dataset at ``path`` (a data file or a directory of them).

    Args:
        path: the dataset.
        params: string parameters (see
            :func:`elasticdl.common.reader_params.parse_reader_params`); the reader rejects
            ones it does not know.

    Raises:
        DataError: missing path, empty directory, unknown or mixed formats.
        ValueError: an unknown or invalid parameter.
    """
    params = dict(params or {})
    fmt = params.pop(FORMAT_PARAM, None)
    from elasticdl.data.arrow_reader import hf_dataset_files, is_hf_dataset_dir
    from elasticdl.data.fs import normalize

    if is_hf_dataset_dir(normalize(path)):
        # a Hugging Face datasets save_to_disk directory: its .arrow files, in order
        files = hf_dataset_files(normalize(path))
        fmt = fmt or "arrow"
    else:
        files = dataset_files(path)
    if fmt is None:
        fmt = _detect_format(path, files)
    elif fmt not in _FACTORIES:
        raise DataError(f"{path}: unknown data format {fmt!r}; known: {sorted(_FACTORIES)}")
    logger.info("dataset %s: %d %s file(s)", path, len(files), fmt)
    return _FACTORIES[fmt](files, params)


# --- parameter conversion, shared by the built-in factories ---------------------------------


def _check_keys(fmt: str, params: Mapping[str, str], allowed: Iterable[str]) -> None:
    allowed = set(allowed)
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(
            f"unknown {fmt} reader parameter(s) {unknown}; accepted: {sorted(allowed) or 'none'}"
        )


def _bool(key: str, value: str) -> bool:
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"reader parameter {key}={value!r} is not a boolean (true/false)")


def _positive_int(key: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"reader parameter {key}={value!r} is not an integer") from None
    if number < 1:
        raise ValueError(f"reader parameter {key}={value!r} must be positive")
    return number


def _separator(value: str) -> str:
    sep = _SEPARATOR_NAMES.get(value.lower(), value)
    if len(sep) != 1:
        raise ValueError(
            f"reader parameter sep={value!r} must be one character or one of "
            f"{sorted(_SEPARATOR_NAMES)}"
        )
    return sep


def _create_csv(files: Sequence[str], params: Mapping[str, str]) -> DataReader:
    from elasticdl.data.csv_reader import CSVDataReader

    _check_keys("csv", params, ("sep", "header", "encoding"))
    return CSVDataReader(
        files,
        sep=_separator(params["sep"]) if "sep" in params else None,
        header=_bool("header", params["header"]) if "header" in params else False,
        encoding=params.get("encoding", "utf-8"),
    )


def _create_text(files: Sequence[str], params: Mapping[str, str]) -> DataReader:
    from elasticdl.data.csv_reader import TextDataReader

    _check_keys("text", params, ("encoding",))
    return TextDataReader(files, encoding=params.get("encoding", "utf-8"))


def _create_numpy(files: Sequence[str], params: Mapping[str, str]) -> DataReader:
    from elasticdl.data.numpy_reader import NPZ_CACHE_FILES, NumPyDataReader

    _check_keys("numpy", params, ("npz_cache_files",))
    cache = params.get("npz_cache_files")
    return NumPyDataReader(
        files,
        npz_cache_files=NPZ_CACHE_FILES
        if cache is None
        else _positive_int("npz_cache_files", cache),
    )


def _create_parquet(files: Sequence[str], params: Mapping[str, str]) -> DataReader:
    from elasticdl.data.parquet_reader import ParquetDataReader

    _check_keys("parquet", params, ("columns",))
    columns = None
    if "columns" in params:
        columns = [c.strip() for c in params["columns"].split(",") if c.strip()]
        if not columns:
            raise ValueError("reader parameter columns= names no column")
    return ParquetDataReader(files, columns=columns)


register_data_reader("csv", _create_csv, (".csv", ".tsv"))
register_data_reader("text", _create_text, (".txt", ".text"))
register_data_reader("numpy", _create_numpy, (".npy", ".npz"))
register_data_reader("parquet", _create_parquet, (".parquet",))


def _create_arrow(files: Sequence[str], params: Mapping[str, str]) -> DataReader:
    from elasticdl.data.arrow_reader import ArrowDataReader

    _check_keys("arrow", params, ("columns",))
    columns = None
    if "columns" in params:
        columns = [c.strip() for c in params["columns"].split(",") if c.strip()]
        if not columns:
            raise ValueError("reader parameter columns= names no column")
    return ArrowDataReader(files, columns=columns)


register_data_reader("arrow", _create_arrow, (".arrow",))
