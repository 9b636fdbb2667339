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
import time
from collections.abc import Callable
from typing import TypeVar

from elasticdl.data.errors import DataError, MalformedRecordError

logger = logging.getLogger("elasticdl.data.fs")   # one logger for the file-system layer

__all__ = ["DEFAULT_RETRY_BUDGET_S", "RETRY_BUDGET_ENV", "is_transient", "redact",
           "retry_budget_s", "retrying"]

RETRY_BUDGET_ENV = "ELASTICDL_DATA_RETRY_S"
"""Environment variable: seconds a remote operation keeps retrying transient errors."""
DEFAULT_RETRY_BUDGET_S = 60.0
_TRANSIENT_NAMES = frozenset({
    "ConnectionError", "HTTPClientError", "EndpointConnectionError", "ConnectionClosedError",
    "ReadTimeoutError", "ConnectTimeoutError", "ProxyConnectionError", "IncompleteRead",
    "ResponseStreamingError", "ClientConnectionError", "ClientPayloadError",
    "ServerDisconnectedError", "ServerTimeoutError", "ClientOSError", "TimeoutError",
    "FSTimeoutError",
})
_TRANSIENT_ERRNOS = frozenset({
    errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
    errno.EBUSY,                    # s3fs: 503 SlowDown
    getattr(errno, "EREMOTEIO", 121),   # s3fs: 500 InternalError
})
_TRANSIENT_CODES = frozenset({"InternalError", "ServiceUnavailable", "SlowDown",
                              "RequestTimeout", "Throttling", "ThrottlingException"})

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


def is_transient(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is worth retrying: a connection refused or reset,
    a timeout, an HTTP 5xx or throttling. Missing objects, denied access and malformed data
    are permanent."""
    chain = _chain(err)
    for e in chain:
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError,
                          NotADirectoryError, MalformedRecordError)):
            return False
    for e in chain:
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0
            if error.get("Code") in _TRANSIENT_CODES or int(status) >= 500:
                return True
        if any(c.__name__ in _TRANSIENT_NAMES for c in type(e).__mro__):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
    return False


def _reason(err: BaseException) -> str:
    if any(isinstance(e, FileNotFoundError) for e in _chain(err)):
        return f"no such bucket or object ({err})"
    if any(isinstance(e, PermissionError) for e in _chain(err)):
        return (f"access denied ({err}); check the credentials (AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY, a credentials file) and --data_endpoint")
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
