"""Data files by local path or URL: the file-system layer every built-in reader uses.

A dataset path is either a plain local path (read with ``open``/``np.load``/pyarrow exactly as
before) or a URL read through `fsspec <https://filesystem-spec.readthedocs.io>`_:

=============  =========================================  ====================================
URL            file system                                install
=============  =========================================  ====================================
``s3://b/k``   s3fs (any S3-compatible endpoint)           ``pip install elasticdl-pytorch[s3]``
``gs://b/k``   gcsfs                                       ``pip install gcsfs``
``hdfs://h/p`` pyarrow's HDFS client (libhdfs)             ``pip install pyarrow``
``file:///p``  the local file system (same as ``/p``)      -
=============  =========================================  ====================================

The S3 endpoint comes from ``--data_endpoint`` (exported to every process of the job as
:data:`ENDPOINT_ENV`), else from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``; credentials from
the usual chain of botocore (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a credentials file,
``AWS_PROFILE``, an instance role). This module never logs or stores a credential.

Faults: every remote operation goes through :func:`retrying` (:mod:`elasticdl.data.fs_faults`):
transient errors are retried within a bounded budget, permanent ones raise
:class:`~elasticdl.data.api.DataError` naming the URL and the reason.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from elasticdl.data.errors import DataError
from elasticdl.data.fs_faults import (
    DEFAULT_RETRY_BUDGET_S,
    RETRY_BUDGET_ENV,
    is_transient,
    redact,
    retry_budget_s,
    retrying,
)

__all__ = [
    "DEFAULT_RETRY_BUDGET_S",
    "ENDPOINT_ENV",
    "RETRY_BUDGET_ENV",
    "RemoteFile",
    "configure_from_spec",
    "exists",
    "filesystem",
    "info",
    "is_transient",
    "is_url",
    "isdir",
    "isfile",
    "join",
    "list_entries",
    "list_files",
    "normalize",
    "open_input",
    "read_bytes",
    "read_range",
    "redact",
    "remove",
    "retry_budget_s",
    "retrying",
    "upload",
    "download",
    "write_bytes",
]

ENDPOINT_ENV = "ELASTICDL_DATA_ENDPOINT"
"""Environment variable holding ``--data_endpoint`` in every process of a job."""
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 30.0
BLOCK_SIZE = 8 << 20
"""Read-ahead block of a remote file opened for streaming (an index build, a Parquet footer)."""

_EXTRA = "pip install 'elasticdl-pytorch[s3]'"
_PROTOCOLS = {
    "s3": ("s3", "s3fs", _EXTRA),
    "s3a": ("s3", "s3fs", _EXTRA),
    "gs": ("gcs", "gcsfs", "pip install gcsfs"),
    "gcs": ("gcs", "gcsfs", "pip install gcsfs"),
    "hdfs": ("hdfs", "pyarrow", "pip install pyarrow"),
}


class RemoteFile(NamedTuple):
    """An object as listed: its URL, size in bytes and version (ETag or mtime)."""

    url: str
    size: int
    version: str


# --- paths ----------------------------------------------------------------------------------


def is_url(path: str) -> bool:
    """Whether ``path`` names a remote object (``scheme://...`` other than ``file://``)."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.isalnum() and scheme.lower() != "file"


def normalize(path: str) -> str:
    """A URL without trailing ``/``; a ``file://`` URL or a plain path as an absolute path."""
    if path.startswith("file://"):
        path = path[len("file://"):]
    if is_url(path):
        scheme, _, rest = path.partition("://")
        return f"{scheme.lower()}://{rest.rstrip('/')}"
    return os.path.abspath(os.path.expanduser(path))


def join(base: str, name: str) -> str:
    """``base/name`` for URLs and paths alike."""
    return f"{base.rstrip('/')}/{name}" if is_url(base) else os.path.join(base, name)


def configure_from_spec(spec: Any) -> None:
    """Export the job's ``--data_endpoint`` to this process and the ones it starts."""
    endpoint = getattr(spec, "data_endpoint", "")
    if endpoint:
        os.environ[ENDPOINT_ENV] = endpoint


# --- file systems ---------------------------------------------------------------------------


def _storage_options(protocol: str) -> dict[str, Any]:
    if protocol != "s3":
        return {}
    options: dict[str, Any] = {
        "config_kwargs": {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S,
                          "retries": {"max_attempts": 2, "mode": "standard"}},
    }
    endpoint = (os.environ.get(ENDPOINT_ENV) or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL"))
    if endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    return options


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec file system, path within it)`` for a URL (instances cached per process).

    Raises:
        DataError: an unknown scheme, or the library for it is not installed (the message
            names what to install).
    """
    scheme, _, rest = url.partition("://")
    entry = _PROTOCOLS.get(scheme.lower())
    if entry is None:
        raise DataError(f"{redact(url)}: unsupported URL scheme {scheme!r}; supported: "
                        f"{', '.join(sorted(_PROTOCOLS))}, file:// and plain paths")
    protocol, module, install = entry
    try:
        from fsspec.core import url_to_fs

        __import__(module)
        # the host and port of hdfs://host:port/path become the client's, as fsspec parses them
        fs, path = url_to_fs(f"{protocol}://{rest}", **_storage_options(protocol))
    except ImportError as err:
        raise DataError(f"{redact(url)}: reading {scheme}:// URLs requires {module}, which is "
                        f"not installed ({install}): {err}") from err
    if protocol == "s3":
        fs.retries = 2    # s3fs's own retries of a call; ours (retrying) bound the total
    return fs, path


# --- operations (plain paths use the local file system directly) ----------------------------


def info(url: str) -> RemoteFile:
    """Size and version of a file or object.

    Raises:
        DataError: no such object, access denied, or the store unreachable past the budget.
    """
    if not is_url(url):
        try:
            st = os.stat(url)
        except OSError as err:
            raise DataError(f"{url}: cannot read: {err}") from err
        return RemoteFile(url, st.st_size, str(st.st_mtime_ns))
    fs, path = filesystem(url)

    def op() -> RemoteFile:
        d = fs.info(path)
        if d.get("type") == "directory":
            raise IsADirectoryError(f"{url} is a directory")
        version = d.get("ETag") or d.get("etag") or d.get("generation") or d.get("mtime") \
            or d.get("LastModified") or ""
        return RemoteFile(url, int(d["size"]), str(version).strip('"'))

    return retrying(url, "stat", op)


def exists(url: str) -> bool:
    """Whether a file, object or directory (prefix) exists."""
    if not is_url(url):
        return os.path.exists(url)
    fs, path = filesystem(url)
    return retrying(url, "stat", lambda: bool(fs.exists(path)))


def isfile(url: str) -> bool:
    """Whether ``url`` is a file or object."""
    if not is_url(url):
        return os.path.isfile(url)
    fs, path = filesystem(url)
    return retrying(url, "stat", lambda: bool(fs.isfile(path)))


def isdir(url: str) -> bool:
    """Whether ``url`` is a directory (an S3 prefix holding objects)."""
    if not is_url(url):
        return os.path.isdir(url)
    fs, path = filesystem(url)
    return retrying(url, "stat", lambda: bool(fs.isdir(path)))


def list_files(url: str) -> list[RemoteFile]:
    """The files directly under a directory URL (non-recursive), sorted, with sizes: one
    listing request per 1000 objects, however many workers later read them.

    Raises:
        DataError: no such bucket/prefix, access denied, unreachable past the budget.
    """
    fs, path = filesystem(url)
    scheme = url.partition("://")[0]

    def op() -> list[RemoteFile]:
        entries = fs.ls(path, detail=True, refresh=True)
        out = []
        for d in entries:
            if d.get("type") != "file":
                continue
            name = str(d["name"])
            full = name if "://" in name else f"{scheme}://{name.lstrip('/')}"
            if scheme == "hdfs":
                full = f"{url.rstrip('/')}/{name.rstrip('/').rsplit('/', 1)[-1]}"
            version = d.get("ETag") or d.get("etag") or d.get("mtime") or ""
            out.append(RemoteFile(full, int(d.get("size") or 0), str(version).strip('"')))
        return sorted(out)

    return retrying(url, "list", op)


def read_range(url: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a file or object (one ranged GET for an object).

    Raises:
        DataError: fewer bytes than asked (the object changed), or a read error.
    """
    if end <= start:
        return b""
    if not is_url(url):
        try:
            with open(url, "rb") as f:
                f.seek(start)
                data = f.read(end - start)
        except OSError as err:
            raise DataError(f"{url}: cannot read: {err}") from err
    else:
        fs, path = filesystem(url)
        data = retrying(url, f"read bytes {start}-{end}",
                        lambda: fs.cat_file(path, start=start, end=end))
    if len(data) != end - start:
        raise DataError(f"{redact(url)}: holds fewer bytes than when it was indexed "
                        f"(asked {start}-{end}, got {len(data)})")
    return bytes(data)


def read_bytes(url: str) -> bytes:
    """The whole file or object (small files only: metadata, a state.json)."""
    if not is_url(url):
        try:
            with open(url, "rb") as f:
                return f.read()
        except OSError as err:
            raise DataError(f"{url}: cannot read: {err}") from err
    fs, path = filesystem(url)
    return bytes(retrying(url, "read", lambda: fs.cat_file(path)))


def open_input(url: str, block_size: int = BLOCK_SIZE, exact: bool = False) -> Any:
    """A seekable binary file for reading. Remote: each read is a ranged GET of at least
    ``block_size`` bytes (read-ahead, for many small reads), or with ``exact`` of exactly the
    bytes asked (for a reader that asks for whole column chunks, as pyarrow does).

    Errors while reading the returned file surface as the file system raises them; wrap the
    whole use in :func:`retrying`.
    """
    if not is_url(url):
        return open(url, "rb")
    fs, path = filesystem(url)
    return fs.open(path, "rb", block_size=block_size,
                   cache_type="none" if exact else "readahead")


def write_bytes(url: str, data: bytes) -> None:
    """Write a whole file or object atomically (local: a temporary file renamed; object
    stores: a single PUT is atomic)."""
    if not is_url(url):
        tmp = f"{url}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(url) or ".", exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, url)
        except OSError as err:
            raise DataError(f"{url}: cannot write: {err}") from err
        return
    fs, path = filesystem(url)
    retrying(url, "write", lambda: fs.pipe_file(path, data))


def upload(local_path: str, url: str) -> None:
    """Copy a local file to an object (streamed; multipart for large files)."""
    fs, path = filesystem(url)
    retrying(url, "upload", lambda: fs.put_file(local_path, path))


def download(url: str, local_path: str) -> None:
    """Copy an object to a local file (written beside, then renamed into place)."""
    fs, path = filesystem(url)
    os.makedirs(os.path.dirname(local_path) or ".", exist_ok=True)
    tmp = f"{local_path}.{os.getpid()}.part"
    retrying(url, "download", lambda: fs.get_file(path, tmp))
    os.replace(tmp, local_path)


def remove(url: str) -> None:
    """Delete an object, or every object under a prefix; a missing one is no error."""
    fs, path = filesystem(url)

    def op() -> None:
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    retrying(url, "delete", op)


def list_entries(url: str) -> list[tuple[str, bool]]:
    """``(name, is_directory)`` of the entries directly under a prefix (none when it does
    not exist)."""
    fs, path = filesystem(url)

    def op() -> list[tuple[str, bool]]:
        try:
            entries = fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        return sorted((str(d["name"]).rstrip("/").rsplit("/", 1)[-1],
                       d.get("type") == "directory") for d in entries)

    return retrying(url, "list", op)
