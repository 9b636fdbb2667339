"""Row storage that grows without copying: arrays over reserved address space.

A lazy table's rows (weights, each optimizer slot, the slot -> id array, the dirty marks)
and its id index live in anonymous mappings reserved once for the most rows the table can
hold on this PS (``MAP_NORESERVE``: address space only; a page becomes memory when a row on
it is first written). Growth is then only a larger ``size``: no second copy of the table,
no doubling slack, and no per-row Python object. Freed (a table dropped by a rollback, a
checkpoint's snapshot written) the mapping goes back to the system at once, where the
heap would keep it (the PS raises malloc's trim threshold, ``common/malloc.py``).

Each array reserves at most ``RESERVE_BYTES`` of address space (256 GiB) and 2^31 - 1 rows
(a 2^40-id table of 16 floats reserves 2^31 - 1 rows per PS: 128 GiB of addresses for
its weights); a table that outgrows it moves to ordinary tensors
that grow by doubling (a copy), as before. Where the system refuses the reservation (strict
overcommit) :func:`reserve` answers None and the caller uses ordinary tensors.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import weakref
from typing import Any, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

RESERVE_BYTES = 1 << 38
MIN_ROWS = 1 << 16     # below this, plain arrays are as good
MAX_ROWS = 2**31 - 1   # slots fit an int32 (the index's values)
_MAP_NORESERVE = 0x4000   # Linux; not exported by Python's mmap module before 3.13
_refused = False
_MAPPINGS: dict[int, mmap.mmap] = {}   # address -> mapping, of the tensors reserve() made


def _libc_madvise() -> Optional[Any]:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def reserve_rows(row_bytes: int, rows: int) -> int:
    """How many rows of ``row_bytes`` an array may reserve (at most ``rows``)."""
    return max(0, min(rows, RESERVE_BYTES // max(row_bytes, 1), MAX_ROWS))


def reserve(rows: int, tail: tuple[int, ...], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A zero tensor of ``rows`` x ``tail`` over an anonymous mapping (None: refused,
    or too small to be worth one)."""
    global _refused
    if _refused or rows < MIN_ROWS:
        return None
    numel = rows * int(np.prod(tail, dtype=np.int64)) if tail else rows
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS |
                        _MAP_NORESERVE)
    except OSError as e:
        _refused = True
        logger.warning("cannot reserve %d bytes of address space (%s): tables grow by "
                       "copying", nbytes, e)
        return None
    t = torch.frombuffer(buf, dtype=dtype, count=numel).view((rows,) + tail)
    # for release(): by address, until the tensor is gone (an attribute on the tensor
    # would be pickled by torch.save)
    address = t.data_ptr()
    _MAPPINGS[address] = buf
    weakref.finalize(t, _MAPPINGS.pop, address, None)
    return t


RELEASE_STEP = 16 << 20   # bytes handed back per madvise call (release)


def release(*tensors: torch.Tensor) -> None:
    """Hand the pages of mappings made by :func:`reserve`/:func:`buffer` back now, a
    ``RELEASE_STEP`` at a time (others: nothing). Their contents become zeros: call it
    only on what is dropped next.

    Unmapping 1.3 GB of written pages at once (a 1e7-row checkpoint snapshot dropped)
    holds the process's memory-map lock for ~90 ms, and every thread that faults a page
    in or grows the heap meanwhile waits (a hot pull's round trip 48 ms instead of 1);
    ``MADV_DONTNEED`` a step at a time takes that lock for reading only, and the unmap
    that follows finds nothing to free (longest wait 4 ms, measured). Called through
    ctypes, which lets go of the GIL during each call: Python's ``mmap.madvise`` keeps
    it, and 80 of those calls in a row held a PS's RPC threads off for 106 ms."""
    for t in tensors:
        address = t.data_ptr()
        mapping = _MAPPINGS.get(address)
        if mapping is None or mapping.closed:
            continue
        size = len(mapping)
        for offset in range(0, size, RELEASE_STEP):
            step = min(RELEASE_STEP, size - offset)
            if _madvise is None:
                mapping.madvise(mmap.MADV_DONTNEED, offset, step)
            else:   # through ctypes: the GIL is released while it runs (mmap's keeps it)
                _madvise(ctypes.c_void_p(address + offset), ctypes.c_size_t(step),
                         mmap.MADV_DONTNEED)


def array(rows: int, dtype: type) -> Optional[np.ndarray]:
    """:func:`reserve` as a 1-D numpy array."""
    t = reserve(rows, (), {np.int64: torch.int64, np.int32: torch.int32,
                           np.uint32: torch.int32, np.bool_: torch.bool}[dtype])
    return None if t is None else t.numpy().view(dtype)


def buffer(rows: int, tail: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor that returns its memory when freed (a mapping when big)."""
    t = reserve(rows, tail, dtype) if rows >= MIN_ROWS else None
    return t if t is not None else torch.empty((rows,) + tail, dtype=dtype)


def merge_into(keys: np.ndarray, values: np.ndarray, n: int, new_keys: np.ndarray,
               new_values: np.ndarray, chunk: int = 1 << 20) -> int:
    """Insert sorted ``new_keys`` (absent from ``keys[:n]``, sorted) in place, keeping
    ``keys[:n + m]`` sorted and ``values`` aligned; returns ``n + m``. The old entries move
    towards the end a chunk at a time from the back (no copy of the arrays)."""
    m = new_keys.shape[0]
    pos = np.searchsorted(keys[:n], new_keys)     # new j lands at pos[j] + j
    hi = n
    while hi > 0:
        lo = max(0, hi - chunk)
        idx = np.arange(lo, hi, dtype=np.int64)
        shift = np.searchsorted(pos, idx, side="right")
        if shift[-1] == 0:     # nothing at or before hi moves
            break
        keys[idx + shift] = keys[lo:hi].copy()
        values[idx + shift] = values[lo:hi].copy()
        hi = lo
    dest = pos + np.arange(m, dtype=np.int64)
    keys[dest] = new_keys
    values[dest] = new_values
    return n + m
