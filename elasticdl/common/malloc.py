"""Process-wide allocator settings for processes that move tensor-sized buffers (the PS and
the PS strategy's workers)."""

from __future__ import annotations

import ctypes
import logging
import threading
import time

logger = logging.getLogger(__name__)


PS_MALLOC_ARENAS = 2   # a PS's malloc arenas (tune_malloc's max_arenas)


def tune_malloc(max_arenas: int = 0) -> None:
    """Keep large freed buffers in the heap (glibc only).

    Every transfer allocates tensor-sized byte buffers; glibc serves those
    from fresh ``mmap``s whose first touch page-faults, which makes a copy of
    40 MB several times slower than a copy into reused memory (measured in
    benchmarks/ps_bandwidth.py). Raising the mmap and trim thresholds lets
    freed buffers be reused. A no-op where glibc is absent.

    ``max_arenas`` (0: glibc's default, 8 per core) bounds the heaps glibc keeps for
    threads: a PS's gRPC threads each got one, each keeping what its requests left
    behind (a PS grown to 1e7 rows: 158.9 B/row of RSS with the default, 150.4 with 2,
    the store itself 149; filling the table took 35.5 s and 36.2 s:
    ``benchmarks/ps_table_scale.py``). The PS's work runs under its shard lock anyway.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.debug("not glibc: malloc left as it is")
        return
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    ok = mallopt(m_mmap_threshold, 1 << 30) and mallopt(m_trim_threshold, 1 << 30)
    if max_arenas > 0:
        ok = ok and mallopt(m_arena_max, max_arenas)
    logger.debug("malloc thresholds raised: %s", bool(ok))


TRIM_EVERY_S = 10.0   # how often a PS hands freed heap pages back (ps/main.py)


def release_free_heap() -> float:
    """Hand the heap's free pages back to the system (glibc ``malloc_trim``); returns the
    seconds it took (0.0 where glibc is absent).

    With the raised thresholds above, the temporaries of a burst of pushes (sorting ids,
    index merges, optimizer intermediates, message buffers) leave pages in the heap that
    stay resident after they are freed: about 28 bytes per row created while a PS's table
    grows (``benchmarks/ps_table_scale.py``). The PS calls this every ``TRIM_EVERY_S``;
    a buffer reused after it faults its pages in again once (4 ms to release 85 MB)."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return 0.0
    start = time.monotonic()
    trim(0)
    return time.monotonic() - start


def release_free_heap_every(stop: threading.Event, every_s: float = TRIM_EVERY_S,
                            name: str = "process") -> threading.Thread:
    """A daemon thread calling :func:`release_free_heap` every ``every_s`` until ``stop``."""
    def run() -> None:
        while not stop.wait(every_s):
            took = release_free_heap()
            if took > 0.05:
                logger.info("%s: handing free heap pages back took %.0f ms", name, 1000 * took)

    thread = threading.Thread(target=run, name="heap-trim", daemon=True)
    thread.start()
    return thread
