"""Local id -> slot of the rows of one embedding table on one PS, vectorised.

Up to ``DIRECT_INDEX_MAX`` local ids a direct array (at most 32 MiB, allocated when the
first row is created); beyond, a sorted id array searched with ``np.searchsorted``, whose
size grows with the rows created (12 bytes per row), over reserved address space
(:mod:`elasticdl.ps.row_arena`) when it can be. Removed ids (evicted rows) leave entries
marked -1, dropped a quarter at a time (:meth:`SlotIndex.remove`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from elasticdl.ps import row_arena

DIRECT_INDEX_MAX = 1 << 22
TORCH_SORT_MIN = 1 << 14   # from here torch's sort (radix for integers) beats numpy's


def _sorted(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``keys`` sorted and ``values`` in the same order (a restore's 1e7 ids: 0.3 s
    with torch's sort, 1.3 s with numpy's argsort)."""
    if keys.shape[0] < TORCH_SORT_MIN:
        order = np.argsort(keys, kind="stable")
        return keys[order], values[order]
    k = keys if keys.flags.writeable else keys.copy()   # (torch.from_numpy: writable)
    result = torch.sort(torch.from_numpy(k), stable=True)
    return result.values.numpy(), values[result.indices.numpy()]


class SlotIndex:
    """Local id -> slot of the rows present (-1: absent), vectorised.

    Up to ``DIRECT_INDEX_MAX`` local ids a direct array; beyond, sorted keys and their
    slots, over reserved address space when ``reserve`` rows can be (inserted in place,
    :func:`row_arena.merge_into`: no copy of the index per insert), else arrays that
    ``np.insert`` replaces."""

    def __init__(self, local_size: int, reserve: int = 0):
        self.direct = local_size <= DIRECT_INDEX_MAX
        self._local_size = max(local_size, 0)
        self._array: Optional[np.ndarray] = None  # direct mode
        keys = None if self.direct else row_arena.array(reserve, np.int64)
        values = None if keys is None else row_arena.array(
            reserve, np.int32 if reserve < 2**31 else np.int64)
        self._in_place = keys is not None and values is not None
        self._keys = keys if keys is not None and values is not None else \
            np.empty(0, dtype=np.int64)   # sorted mode: keys[:n], values[:n]
        self._values = values if keys is not None and values is not None else \
            np.empty(0, dtype=np.int64)
        self._n = 0
        # sorted mode: entries of removed ids (value -1; a key's first entry holds its
        # slot, any later one is -1), dropped by compact_step a chunk at a time
        self._dead = 0
        self._cw = self._cr = 0   # compaction in progress: written up to, read up to

    def find(self, local: np.ndarray) -> np.ndarray:
        if self.direct:
            if self._array is None:
                return np.full(local.shape[0], -1, dtype=np.int64)
            return self._array[local]
        n = self._n
        if n == 0:
            return np.full(local.shape[0], -1, dtype=np.int64)
        keys = self._keys[:n]
        pos = np.searchsorted(keys, local)
        np.minimum(pos, n - 1, out=pos)
        return np.where(keys[pos] == local, self._values[:n][pos].astype(np.int64), -1)

    def insert(self, local: np.ndarray, slots: np.ndarray) -> None:
        """Add ids not present yet."""
        if self.direct:
            if self._array is None:
                self._array = np.full(self._local_size, -1, dtype=np.int64)
            self._array[local] = slots
            return
        local, slots = _sorted(local, slots)
        n = self._n
        if self._dead and n:   # a removed id back: its key is still there
            pos = np.minimum(np.searchsorted(self._keys[:n], local), n - 1)
            back = self._keys[pos] == local
            if back.any():
                self._values[pos[back]] = slots[back]
                self._dead -= int(back.sum())
                local, slots = local[~back], slots[~back]
                if local.shape[0] == 0:
                    return
        self._cw = self._cr = 0   # entries move: a compaction starts over (still sorted)
        if self._dead * 4 > n:   # the merge below moves the index anyway: drop them first
            while self.compact_step(n):
                pass
            n = self._n
        if self._in_place and n + local.shape[0] <= self._keys.shape[0]:
            self._n = row_arena.merge_into(self._keys, self._values, n, local, slots)
            return
        self._in_place = False   # out of reserved space: arrays replaced per insert
        keys, values = self._keys[:n], self._values[:n]
        pos = np.searchsorted(keys, local)
        self._keys = np.insert(keys, pos, local)
        self._values = np.insert(values, pos, slots)
        self._n = self._keys.shape[0]

    def remove(self, local: np.ndarray) -> None:
        """Forget ids (present). Sorted mode marks their entries removed (-1); once a
        quarter of the entries are removed ones they are dropped: by the next insert of
        new ids (whose in-place merge moves the index anyway: O(entries) either way), or
        without inserts by :meth:`compact_step` a chunk at a time (the sweep's), and here,
        at once, if three quarters are (the steps fell behind)."""
        if self.direct:
            if self._array is not None:
                self._array[local] = -1
            return
        n = self._n
        pos = np.searchsorted(self._keys[:n], local)
        self._values[pos] = -1
        self._dead += int(local.shape[0])
        if self._dead * 4 > 3 * n:
            self._cw = self._cr = 0
            while self.compact_step(n):
                pass

    def compact_step(self, budget: int = 1 << 18) -> bool:
        """Drop the removed entries of the next ``budget`` entries (sorted mode; starts
        once a quarter of the entries are removed ones); True while a pass is under way.

        In place, from the front: live entries move down to the write cursor, and the gap
        up to the read cursor is filled with copies of the last live key (value -1), so
        the arrays stay sorted and each key's first entry stays its slot between steps."""
        n = self._n
        if self.direct or n == 0 or (self._cr == 0 and self._dead * 4 <= n):
            return False
        w, r = self._cw, self._cr
        hi = min(r + budget, n)
        values = self._values[r:hi]
        live = values >= 0
        m = int(live.sum())
        keys_live, values_live = self._keys[r:hi][live], values[live]
        self._keys[w:w + m], self._values[w:w + m] = keys_live, values_live
        w += m
        self._keys[w:hi] = self._keys[w - 1] if w > 0 else -1
        self._values[w:hi] = -1
        if hi < n:
            self._cw, self._cr = w, hi
            return True
        self._n, self._dead = w, self._dead - (n - w)
        self._cw = self._cr = 0
        return False

    @property
    def nbytes(self) -> int:
        if self.direct:
            return 0 if self._array is None else self._array.nbytes
        return self._n * (self._keys.itemsize + self._values.itemsize)
