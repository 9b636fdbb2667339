"""Producing the next minibatches in a background thread while the current one trains.

:class:`Prefetcher` runs an iterator (read, ``feed``, a DataLoader's iteration) in one
daemon thread, at most ``depth`` items ahead of the consumer. An exception in the
producer reaches the consumer at the item where it happened, as the same exception
object (its type, message naming the file and record, and traceback kept), after the
items produced before it. :meth:`Prefetcher.close` stops the producer without waiting
for it to finish its iterator: a consumer that gives up early (a failed step) never
hangs. With ``item_timeout_s`` the consumer waits at most that long for one item and
then raises :class:`PrefetchTimeout` naming the prefetcher (a producer stuck in user
code cannot be interrupted from another thread; the error lets the caller fail its
task and, the process ending, the stuck thread with it). Torch-free.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ITEM, _ERROR, _END = 0, 1, 2
_POLL_S = 0.1


class PrefetchTimeout(TimeoutError):
    """The producer made no item within the prefetcher's ``item_timeout_s``."""


class Prefetcher(Generic[T]):
    """Iterate ``items`` in a background thread, ``depth`` items ahead.

    Use as an iterator, and :meth:`close` it (or use ``with``) when done or giving up.
    ``depth`` 0 iterates in the caller's thread (no thread, no look-ahead, no timeout).
    ``item_timeout_s``: the longest wait for one item (None: forever; module docs).
    """

    def __init__(self, items: Iterable[T], depth: int = 2, name: str = "prefetch",
                 item_timeout_s: float | None = None):
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        if item_timeout_s is not None and item_timeout_s <= 0:
            raise ValueError(f"item_timeout_s must be > 0 or None, got {item_timeout_s}")
        self.name = name
        self.item_timeout_s = item_timeout_s
        self._it: Iterator[T] = iter(items)
        self.depth = depth
        self._closed = False
        self._done = False
        self._thread: threading.Thread | None = None
        if depth:
            self._queue: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=depth)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._produce, name=name, daemon=True)
            self._thread.start()

    # --------------------------------------------------------------- producer
    def _produce(self) -> None:
        try:
            for item in self._it:
                if not self._put((_ITEM, item)):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, re-raised there
            self._put((_ERROR, e))
            return
        finally:
            close = getattr(self._it, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001 - a generator's cleanup; the item or
                    logger.debug("closing the prefetched iterator failed", exc_info=True)
        self._put((_END, None))

    def _put(self, message: tuple[int, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(message, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    # --------------------------------------------------------------- consumer
    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._closed or self._done:
            raise StopIteration
        if self._thread is None:
            try:
                return next(self._it)
            except StopIteration:
                self._done = True
                raise
        deadline = None if self.item_timeout_s is None else \
            time.monotonic() + self.item_timeout_s
        while True:
            try:
                kind, value = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    # the producer always ends with a message; this is a safety net
                    self._done = True
                    raise RuntimeError("the prefetch thread ended without a result") from None
                if deadline is not None and time.monotonic() > deadline:
                    self.close()
                    raise PrefetchTimeout(
                        f"{self.name}: no item within {self.item_timeout_s:g} s (the "
                        "producer is stuck reading or loading data)") from None
        if kind == _ITEM:
            return value
        self._done = True
        if kind == _ERROR:
            raise value
        raise StopIteration

    def close(self) -> None:
        """Stop the producer (it ends at its next item) and drop what it made ahead."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            close = getattr(self._it, "close", None)
            if close is not None:
                close()
            return
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
