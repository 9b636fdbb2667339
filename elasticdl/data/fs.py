"""Data files by local path or URL: the file-system layer every built-in reader uses.

A dataset path is either a plain local path (read with ``open``/``np.load``/pyarrow exactly as
before) or a URL read through one of pyarrow's file systems (``pyarrow.fs``):

=============  ==========================================  ==================================
URL            file system                                 install
=============  ==========================================  ==================================
``s3://b/k``   ``S3FileSystem`` (AWS or any S3 endpoint)   ``pip install elasticdl-pytorch[s3]``
``gs://b/k``   ``GcsFileSystem``                           ``pip install elasticdl-pytorch[gcs]``
``hdfs://h/p`` ``HadoopFileSystem`` (libhdfs)              ``pip install pyarrow``
``file:///p``  the local file system (same as ``/p``)      -
=============  ==========================================  ==================================

:func:`filesystem` hands them out behind fsspec's interface
(``fsspec.implementations.arrow.ArrowFSWrapper``, whose ``.fs`` is the pyarrow one); the
operations below call pyarrow directly. Not s3fs/gcsfs: they need botocore, whose
``python-dateutil<3`` cannot be installed beside kubernetes 37's ``>=3``.

The S3 endpoint comes from ``--data_endpoint`` (exported to every process of the job as
:data:`ENDPOINT_ENV`), else from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``; the region from
``AWS_REGION`` / ``AWS_DEFAULT_REGION``, else :data:`DEFAULT_REGION` for an S3-compatible
endpoint; credentials from the AWS SDK's default chain inside pyarrow
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a credentials file, ``AWS_PROFILE``, an
instance or IRSA role). This module never passes, logs or stores a credential: a file system
is cached per process under a digest of the environment it was built from, so a changed
endpoint or credential gets a new one.

Faults: every remote operation goes through :func:`retrying` (:mod:`elasticdl.data.fs_faults`):
transient errors are retried within a bounded budget, permanent ones raise
:class:`~elasticdl.data.api.DataError` naming the URL and the reason.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import os
import threading
from collections import OrderedDict
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from elasticdl.data.errors import DataError
from elasticdl.data.fs_faults import (
    DEFAULT_RETRY_BUDGET_S,
    RETRY_BUDGET_ENV,
    is_not_found,
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
REQUEST_TIMEOUT_S = 30.0
S3_MAX_ATTEMPTS = 2
"""Attempts of one request inside pyarrow's S3 client; :func:`retrying` bounds the total."""
GCS_RETRY_TIME_LIMIT_S = 15.0
DEFAULT_REGION = "us-east-1"
"""Region signed for an S3-compatible endpoint when the environment names none."""
BLOCK_SIZE = 8 << 20
"""Read-ahead block of a remote file opened for streaming (an index build, a Parquet footer)."""
COPY_CHUNK = 8 << 20
OPEN_FILES = 64
"""Objects whose handle (size known: no HEAD per read) :func:`read_range` keeps per process."""

_EXTRA = "pip install 'elasticdl-pytorch[s3]'"
_PROTOCOLS = {
    "s3": ("s3", _EXTRA),
    "s3a": ("s3", _EXTRA),
    "gs": ("gcs", "pip install 'elasticdl-pytorch[gcs]'"),
    "gcs": ("gcs", "pip install 'elasticdl-pytorch[gcs]'"),
    "hdfs": ("hdfs", "pip install pyarrow (and libhdfs, as pyarrow documents)"),
}
_REQUIRED = ("pyarrow.fs", "fsspec.implementations.arrow")
# what a file system is built from: a change gives a new instance (held only as a digest)
_ENVIRONMENT = {
    "s3": (ENDPOINT_ENV, "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION",
           "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
           "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
           "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"),
    "gcs": ("GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CORE_PROJECT", "GOOGLE_CLOUD_PROJECT"),
    "hdfs": ("HADOOP_USER_NAME", "KRB5CCNAME", "HADOOP_CONF_DIR", "CLASSPATH"),
}

_lock = threading.Lock()
_instances: dict[tuple[Any, ...], Any] = {}
_handles: OrderedDict[tuple[int, str], Any] = OrderedDict()
_pid = os.getpid()


class RemoteFile(NamedTuple):
    """An object as listed: its URL, size in bytes and version (ETag, generation or mtime)."""

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


def _s3_options() -> dict[str, Any]:
    """Keyword arguments of ``pyarrow.fs.S3FileSystem`` from the environment: endpoint,
    region, timeouts, retries; never a credential (the SDK's default chain finds those)."""
    import pyarrow.fs as pafs

    options: dict[str, Any] = {
        "connect_timeout": CONNECT_TIMEOUT_S, "request_timeout": REQUEST_TIMEOUT_S,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=S3_MAX_ATTEMPTS),
    }
    endpoint = (os.environ.get(ENDPOINT_ENV) or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL"))
    if endpoint:
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        options["endpoint_override"] = parts.netloc.rsplit("@", 1)[-1]
        options["scheme"] = parts.scheme or "https"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region or endpoint:
        options["region"] = region or DEFAULT_REGION
    return options


def _environment_digest(protocol: str) -> str:
    values = "\0".join(os.environ.get(k, "") for k in _ENVIRONMENT.get(protocol, ()))
    return hashlib.sha256(values.encode()).hexdigest()


def _make(protocol: str, netloc: str) -> Any:
    import pyarrow.fs as pafs
    from fsspec.implementations.arrow import ArrowFSWrapper

    if protocol == "s3":
        native = pafs.S3FileSystem(**_s3_options())
    elif protocol == "gcs":
        native = pafs.GcsFileSystem(
            retry_time_limit=datetime.timedelta(seconds=GCS_RETRY_TIME_LIMIT_S))
    else:     # hdfs://[user@]host[:port]/path; connects now (libhdfs)
        user, _, hostport = netloc.rpartition("@")
        host, _, port = hostport.partition(":")
        native = pafs.HadoopFileSystem(host or "default", int(port or 0), user=user or None)
    return ArrowFSWrapper(native, skip_instance_cache=True)


def _clear_cache() -> None:
    """Forget every file system and open handle of this process (tests; after a fork)."""
    global _pid
    with _lock:
        _instances.clear()
        _handles.clear()
        _pid = os.getpid()


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec file system, path within it)`` for a URL: an ``ArrowFSWrapper`` over
    pyarrow's file system for the scheme (its ``.fs``), cached per process and environment.

    Raises:
        DataError: an unknown scheme, pyarrow or fsspec not installed (the message names
            what to install), or an HDFS client that cannot connect.
    """
    scheme, _, rest = url.partition("://")
    entry = _PROTOCOLS.get(scheme.lower())
    if entry is None:
        raise DataError(f"{redact(url)}: unsupported URL scheme {scheme!r}; supported: "
                        f"{', '.join(sorted(_PROTOCOLS))}, file:// and plain paths")
    protocol, install = entry
    try:
        for module in _REQUIRED:
            __import__(module)
    except ImportError as err:
        raise DataError(f"{redact(url)}: reading {scheme}:// URLs requires pyarrow and fsspec, "
                        f"which are not installed ({install}): {err}") from err
    netloc, _, path = rest.partition("/")
    if protocol == "hdfs":
        path = f"/{path}"
    else:
        path = f"{netloc}/{path}".rstrip("/")
        netloc = ""
    key = (protocol, netloc, _environment_digest(protocol))
    if os.getpid() != _pid:
        _clear_cache()      # a forked child builds clients of its own
    with _lock:
        fs = _instances.get(key)
    if fs is None:
        try:
            fs = _make(protocol, netloc)
        except OSError as err:
            raise DataError(f"{redact(url)}: cannot connect: {err}") from err
        with _lock:
            fs = _instances.setdefault(key, fs)
    return fs, path


def _native(url: str) -> tuple[Any, str]:
    fs, path = filesystem(url)
    return fs.fs, path


def _metadata_version(meta: Any) -> str:
    meta = {k.decode() if isinstance(k, bytes) else k: v for k, v in (meta or {}).items()}
    for name in ("ETag", "etag", "generation", "Last-Modified"):
        value = meta.get(name)
        if value:
            return (value.decode() if isinstance(value, bytes) else str(value)).strip('"')
    return ""


def _mtime_version(file_info: Any) -> str:
    mtime_ns = getattr(file_info, "mtime_ns", None)
    return str(mtime_ns) if mtime_ns is not None else ""


def _handle(url: str, at_least: int = 0, fresh: bool = False) -> Any:
    """A random-access handle of an object (its size known: reads by range need no HEAD),
    kept per process; opened anew (one HEAD) when ``fresh`` or when it holds fewer than
    ``at_least`` bytes (the object was rewritten since)."""
    native, path = _native(url)
    key = (id(native), path)
    with _lock:
        handle = None if fresh else _handles.get(key)
        if handle is not None:
            _handles.move_to_end(key)
    if handle is None or handle.size() < at_least:
        handle = native.open_input_file(path)
        with _lock:
            _handles[key] = handle
            while len(_handles) > OPEN_FILES:
                _handles.popitem(last=False)
    return handle


def _forget(url: str) -> None:
    """Drop the kept handle of ``url`` (after an error or a write)."""
    try:
        native, path = _native(url)
    except DataError:
        return
    with _lock:
        _handles.pop((id(native), path), None)




# --- operations (plain paths use the local file system directly) ----------------------------


def info(url: str) -> RemoteFile:
    """Size and version of a file or object (one HEAD request for an object).

    Raises:
        DataError: no such object (or a directory), access denied, or the store
            unreachable past the budget.
    """
    if not is_url(url):
        try:
            st = os.stat(url)
        except OSError as err:
            raise DataError(f"{url}: cannot read: {err}") from err
        return RemoteFile(url, st.st_size, str(st.st_mtime_ns))
    native, path = _native(url)

    def op() -> RemoteFile:
        try:
            handle = _handle(url, fresh=True)     # one HEAD; the handle kept for reads
        except FileNotFoundError:
            _forget(url)
            if native.get_file_info(path).type.name == "Directory":
                raise IsADirectoryError(f"{url} is a directory") from None
            raise
        version = _metadata_version(handle.metadata()) or \
            _mtime_version(native.get_file_info(path))
        return RemoteFile(url, int(handle.size()), version)

    return retrying(url, "stat", op)


def _type(url: str) -> str:
    native, path = _native(url)
    return retrying(url, "stat", lambda: native.get_file_info(path).type.name)


def exists(url: str) -> bool:
    """Whether a file, object or directory (prefix) exists."""
    if not is_url(url):
        return os.path.exists(url)
    return _type(url) != "NotFound"


def isfile(url: str) -> bool:
    """Whether ``url`` is a file or object."""
    if not is_url(url):
        return os.path.isfile(url)
    return _type(url) == "File"


def isdir(url: str) -> bool:
    """Whether ``url`` is a directory (an S3 prefix holding objects)."""
    if not is_url(url):
        return os.path.isdir(url)
    return _type(url) == "Directory"


def _listing(native: Any, path: str) -> list[Any]:
    import pyarrow.fs as pafs

    return list(native.get_file_info(pafs.FileSelector(path, recursive=False)))


def list_files(url: str) -> list[RemoteFile]:
    """The files directly under a directory URL (non-recursive), sorted, with sizes: one
    listing request per 1000 objects, however many workers later read them; an object's
    URL lists the object itself.

    Raises:
        DataError: no such bucket/prefix, access denied, unreachable past the budget.
    """
    native, path = _native(url)
    scheme = url.partition("://")[0]

    def entry(d: Any) -> RemoteFile:
        if scheme == "hdfs":
            full = f"{url.rstrip('/')}/{d.path.rstrip('/').rsplit('/', 1)[-1]}"
        else:
            full = f"{scheme}://{d.path.lstrip('/')}"
        return RemoteFile(full, int(d.size or 0), _mtime_version(d))

    def op() -> list[RemoteFile]:
        try:
            entries = _listing(native, path)
        except (FileNotFoundError, NotADirectoryError):
            d = native.get_file_info(path)    # an object, not a prefix?
            if d.type.name != "File":
                raise
            return [RemoteFile(url, int(d.size or 0), _mtime_version(d))]
        return sorted(entry(d) for d in entries if d.type.name == "File")

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
        def op() -> bytes:
            try:
                handle = _handle(url, at_least=end)
                size = handle.size()
                return handle.read_at(min(end, size) - start, start) if start < size else b""
            except BaseException:
                _forget(url)     # the next attempt opens the object anew
                raise

        data = retrying(url, f"read bytes {start}-{end}", op)
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
    native, path = _native(url)

    def op() -> bytes:
        with native.open_input_stream(path, compression=None) as f:
            return bytes(f.readall())

    return retrying(url, "read", op)


def open_input(url: str, block_size: int = BLOCK_SIZE, exact: bool = False) -> Any:
    """A seekable binary file for reading. Remote: each read is a ranged GET of at least
    ``block_size`` bytes (read-ahead, for many small reads), or with ``exact`` of exactly the
    bytes asked (pyarrow's own file: for a reader that asks for whole column chunks, as
    pyarrow does).

    Errors while opening or reading the returned file surface as the file system raises them;
    wrap the whole use in :func:`retrying`.
    """
    if not is_url(url):
        return open(url, "rb")
    native, path = _native(url)
    handle = native.open_input_file(path)
    return handle if exact else io.BufferedReader(handle, buffer_size=block_size)


def _write_stream(url: str, chunks: Any) -> None:
    """Write an object from ``chunks()`` (an iterable of bytes): visible only once whole
    (an S3 upload completes at close)."""
    native, path = _native(url)
    _forget(url)
    with native.open_output_stream(path, compression=None) as out:
        for chunk in chunks():
            out.write(chunk)


def write_bytes(url: str, data: bytes) -> None:
    """Write a whole file or object atomically (local: a temporary file renamed; object
    stores: the object appears only once the upload completes)."""
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
    retrying(url, "write", lambda: _write_stream(url, lambda: (data,)))


def upload(local_path: str, url: str) -> None:
    """Copy a local file to an object (streamed in 8 MiB parts)."""
    def chunks() -> Any:
        with open(local_path, "rb") as f:
            while chunk := f.read(COPY_CHUNK):
                yield chunk

    retrying(url, "upload", lambda: _write_stream(url, chunks))


def download(url: str, local_path: str) -> None:
    """Copy an object to a local file (written beside, then renamed into place)."""
    native, path = _native(url)
    os.makedirs(os.path.dirname(local_path) or ".", exist_ok=True)
    tmp = f"{local_path}.{os.getpid()}.part"

    def op() -> None:
        with native.open_input_stream(path, compression=None) as src, open(tmp, "wb") as dst:
            while chunk := src.read(COPY_CHUNK):
                dst.write(chunk)

    try:
        retrying(url, "download", op)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    os.replace(tmp, local_path)


def remove(url: str) -> None:
    """Delete an object, or every object under a prefix; a missing one is no error."""
    native, path = _native(url)
    _forget(url)

    def op() -> None:
        kind = native.get_file_info(path).type.name
        try:
            if kind == "Directory":
                native.delete_dir(path)
            elif kind == "File":
                native.delete_file(path)
        except FileNotFoundError:
            pass

    retrying(url, "delete", op)


def list_entries(url: str) -> list[tuple[str, bool]]:
    """``(name, is_directory)`` of the entries directly under a prefix (none when it or its
    bucket does not exist)."""
    native, path = _native(url)

    def op() -> list[tuple[str, bool]]:
        try:
            entries = _listing(native, path)
        except OSError as err:
            if is_not_found(err):
                return []
            raise
        return sorted((d.path.rstrip("/").rsplit("/", 1)[-1], d.type.name == "Directory")
                      for d in entries)

    return retrying(url, "list", op)
