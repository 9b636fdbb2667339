"""Faults of remote storage: which errors are worth retrying, and the bounded retry loop
every remote operation of :mod:`elasticdl.data.fs` goes through.

A transient error (connection refused or reset, timeout, HTTP 5xx, SlowDown) is retried with
exponential backoff within a bounded budget (:data:`RETRY_BUDGET_ENV`, default 60 s), each
retry logged with the URL; a permanent one (403, no such bucket or key, a malformed object), or
a transient one past the budget, raises :class:`~elasticdl.data.api.DataError` naming the URL
and the reason. URLs are shown without credentials (:func:`redact`).
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import time
from collections.abc import Callable
from typing import TypeVar

from elasticdl.data.errors import DataError, MalformedRecordError

logger = logging.getLogger("elasticdl.data.fs")   # one logger for the file-system layer

__all__ = ["DEFAULT_RETRY_BUDGET_S", "RETRY_BUDGET_ENV", "is_not_found", "is_transient",
           "redact", "retry_budget_s", "retrying"]

RETRY_BUDGET_ENV = "ELASTICDL_DATA_RETRY_S"
"""Environment variable: seconds a remote operation keeps retrying transient errors."""
DEFAULT_RETRY_BUDGET_S = 60.0
_TRANSIENT_NAMES = frozenset({"ConnectionError", "TimeoutError"})
_TRANSIENT_ERRNOS = frozenset({
    errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
    errno.EAGAIN, errno.EHOSTUNREACH, errno.ENETUNREACH,
})
# pyarrow's S3 errors are OSErrors whose message names the AWS SDK's error, e.g.
#   "When listing objects under key 'a/' in bucket 'b': AWS Error SLOW_DOWN during
#    ListObjectsV2 operation: Please reduce your request rate."
#   "AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 7, Could not connect
#    to server" (refused; 18: a body cut short; 28: timed out)
#   "AWS Error UNKNOWN (HTTP status 503) during HeadObject operation: No response body."
# GCS's carry google-cloud's status: "google::cloud::Status(UNAVAILABLE: ...)".
_AWS_ERROR = re.compile(r"AWS Error ([A-Z_]+)")
_HTTP_STATUS = re.compile(r"HTTP status (\d{3})")
_GCS_STATUS = re.compile(r"google::cloud::Status\(([A-Z_]+)")
_TRANSIENT_CODES = frozenset({
    "NETWORK_CONNECTION", "SLOW_DOWN", "SERVICE_UNAVAILABLE", "INTERNAL_FAILURE",
    "THROTTLING", "REQUEST_TIMEOUT", "REQUEST_LIMIT_EXCEEDED", "TOO_MANY_REQUESTS",
    # google-cloud
    "UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "INTERNAL", "ABORTED",
})
_DENIED_CODES = frozenset({
    "ACCESS_DENIED", "SIGNATURE_DOES_NOT_MATCH", "INVALID_ACCESS_KEY_ID",
    "INVALID_CLIENT_TOKEN_ID", "MISSING_AUTHENTICATION_TOKEN", "EXPIRED_TOKEN",
    "UNRECOGNIZED_CLIENT", "INVALID_SIGNATURE",
    "PERMISSION_DENIED", "UNAUTHENTICATED",
})
_MISSING_CODES = frozenset({"NO_SUCH_BUCKET", "NO_SUCH_KEY", "RESOURCE_NOT_FOUND", "NOT_FOUND",
                            "NO_SUCH_UPLOAD"})

T = TypeVar("T")


def redact(url: str) -> str:
    """``url`` without any ``user:secret@`` part (what logs and messages show)."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = err
    while cur is not None and cur not in seen and len(seen) < 16:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def _code(err: BaseException) -> tuple[str, int]:
    """The store's error code and HTTP status named in ``err``'s message ("", 0 if none)."""
    text = str(err)
    code = _AWS_ERROR.search(text) or _GCS_STATUS.search(text)
    status = _HTTP_STATUS.search(text)
    return (code.group(1) if code else ""), (int(status.group(1)) if status else 0)


def _denied(e: BaseException) -> bool:
    code, status = _code(e)
    return isinstance(e, PermissionError) or code in _DENIED_CODES or status in (401, 403)


def is_not_found(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) says the bucket, object or prefix does not
    exist (``FileNotFoundError``, ``NO_SUCH_BUCKET``, ``NO_SUCH_KEY``, HTTP 404)."""
    for e in _chain(err):
        code, status = _code(e)
        if isinstance(e, FileNotFoundError) or code in _MISSING_CODES or status == 404:
            return True
    return False


def is_transient(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is worth retrying: a connection refused, reset or
    cut short, a timeout, an HTTP 5xx or 429, throttling. Missing objects, denied access
    and malformed data are permanent."""
    chain = _chain(err)
    for e in chain:
        if isinstance(e, (IsADirectoryError, NotADirectoryError, MalformedRecordError)) or \
                _denied(e):
            return False
    if is_not_found(err):
        return False
    for e in chain:
        code, status = _code(e)
        if code in _TRANSIENT_CODES or status >= 500 or status == 429:
            return True
        if any(c.__name__ in _TRANSIENT_NAMES for c in type(e).__mro__):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
    return False


def _reason(err: BaseException) -> str:
    if any(_denied(e) for e in _chain(err)):
        return (f"access denied ({err}); check the credentials (AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY, a credentials file) and --data_endpoint")
    if is_not_found(err):
        return f"no such bucket or object ({err})"
    return f"{type(err).__name__}: {err}"


def retry_budget_s() -> float:
    """Seconds a remote operation keeps retrying (:data:`RETRY_BUDGET_ENV`)."""
    try:
        return max(0.0, float(os.environ.get(RETRY_BUDGET_ENV, DEFAULT_RETRY_BUDGET_S)))
    except ValueError:
        return DEFAULT_RETRY_BUDGET_S


def retrying(url: str, what: str, op: Callable[[], T], budget_s: float | None = None) -> T:
    """``op()``, retrying transient errors with backoff for at most ``budget_s`` seconds.

    A :class:`DataError` that is not transient propagates as it is; any other permanent
    error, or a transient one past the budget, becomes a :class:`DataError` naming the URL.
    Exceptions that are not I/O errors (``ValueError``, ``TypeError``...) propagate.
    """
    budget = retry_budget_s() if budget_s is None else budget_s
    began = time.monotonic()
    attempt = 0
    while True:
        try:
            return op()
        except Exception as err:  # classified below; nothing is swallowed
            io_error = isinstance(err, (OSError, DataError)) or is_transient(err)
            if not io_error:
                raise
            elapsed = time.monotonic() - began
            if is_transient(err) and elapsed < budget:
                attempt += 1
                delay = min(5.0, 0.2 * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)
                delay = min(delay, max(0.05, budget - elapsed))
                logger.warning("%s: %s failed (%s), retry %d in %.1f s (%.0f of %.0f s spent)",
                               redact(url), what, type(err).__name__, attempt, delay,
                               elapsed, budget)
                time.sleep(delay)
                continue
            if isinstance(err, DataError) and not is_transient(err):
                raise
            after = f" after {attempt + 1} attempts over {elapsed:.0f} s" if attempt else ""
            raise DataError(f"{redact(url)}: cannot {what}{after}: {_reason(err)}") from err
