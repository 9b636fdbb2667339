"""Process-wide allocator settings for processes that move tensor-sized buffers (the PS and
the PS strategy's workers)."""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)


def tune_malloc() -> None:
    """Keep large freed buffers in the heap (glibc only).

    Every transfer allocates tensor-sized byte buffers; glibc serves those
    from fresh ``mmap``s whose first touch page-faults, which makes a copy of
    40 MB several times slower than a copy into reused memory (measured in
    benchmarks/ps_bandwidth.py). Raising the mmap and trim thresholds lets
    freed buffers be reused. A no-op where glibc is absent.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.debug("not glibc: malloc left as it is")
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = mallopt(m_mmap_threshold, 1 << 30) and mallopt(m_trim_threshold, 1 << 30)
    logger.debug("malloc thresholds raised: %s", bool(ok))
