"""Admission of embedding ids: a row only for an id seen ``admit_after`` times.

The candidates (ids without a row) are counted in a fixed-size counting sketch, not a
map: ``counters`` one-byte saturating counters (255 at most), two hashed positions per id,
conservative update (only the smaller of the two grows), and the count of an id is the
smaller of its two counters. Its memory is fixed when the table is created
(``--embedding_admission_counters`` bytes per table and PS), whatever the number of
distinct ids streaming through: at 2 positions per id it holds ``counters / 2`` candidates
at 2 bytes each (within the issue's 4 bytes per candidate) before collisions begin to
count ids together. Collisions only over-count: an id may be admitted early, never late.

Aging keeps the counts about the recent stream: after ``counters`` increments every
counter is halved (one pass over the array: O(1) amortised per increment), so ids seen
once long ago do not fill the sketch, and the estimate stays unbiased for ids whose
occurrences are recent.
"""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xC2B2AE3D27D4EB4F)


class CountingSketch:
    """Approximate occurrence counts of ids, in ``counters`` bytes."""

    def __init__(self, counters: int):
        if counters < 64:
            raise ValueError(f"an admission sketch needs at least 64 counters, got {counters}")
        self.counts = np.zeros(int(counters), dtype=np.uint8)
        self._added = 0   # increments since the last halving

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes

    def _positions(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = ids.astype(np.uint64)
        with np.errstate(over="ignore"):
            h1 = (x * _M1) ^ ((x * _M1) >> np.uint64(29))
            h2 = (x * _M2) ^ ((x * _M2) >> np.uint64(31))
        w = np.uint64(self.counts.shape[0])
        return (h1 % w).astype(np.int64), (h2 % w).astype(np.int64)

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """The counts of ``ids`` (never below the true count since the last halving)."""
        a, b = self._positions(ids)
        return np.minimum(self.counts[a], self.counts[b])

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Count one occurrence of each of ``ids`` (unique); returns their new counts."""
        if ids.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        a, b = self._positions(ids)
        new = np.minimum(np.minimum(self.counts[a], self.counts[b]).astype(np.int64) + 1, 255)
        # conservative update: raise each counter to the new estimate, never beyond
        np.maximum.at(self.counts, a, new.astype(np.uint8))
        np.maximum.at(self.counts, b, new.astype(np.uint8))
        self._added += int(ids.shape[0])
        if self._added >= self.counts.shape[0]:
            self.counts >>= 1
            self._added = 0
        return new
