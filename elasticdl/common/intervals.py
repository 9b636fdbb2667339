"""Sets of integers (task ids) as sorted, disjoint, half-open intervals.

The job's bookkeeping of *finished* work is kept in these, never as one entry
per task: task ids are handed out in creation order and finish almost in that
order, so the set of closed tasks of a whole job is a handful of intervals
(one per hole: a task in flight, a re-queued one). Its size is O(holes), not
O(tasks done): at 1e7 tasks done with 500 in flight, at most ~500 intervals.

Used by the master (tasks closed / settled), the PS ledgers (tasks the master
closed, folded out of the per-minibatch log) and the allreduce trained-record
set. No torch; JSON form: a flat list ``[lo0, hi0, lo1, hi1, ...]``.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence


class IntervalSet:
    """A set of ints stored as disjoint, non-adjacent ``[lo, hi)`` intervals.

    ``add``/``remove``/``__contains__`` cost O(log n + k) for n intervals and k
    intervals merged; set algebra costs O(n + m).
    """

    __slots__ = ("_lo", "_hi")

    def __init__(self, intervals: Iterable[tuple[int, int]] = ()) -> None:
        self._lo: list[int] = []
        self._hi: list[int] = []
        for lo, hi in intervals:
            self.add_range(lo, hi)

    # ------------------------------------------------------------ building
    @classmethod
    def from_flat(cls, flat: Sequence[int]) -> IntervalSet:
        """From ``[lo0, hi0, lo1, hi1, ...]`` (as :meth:`to_flat` gives)."""
        if len(flat) % 2:
            raise ValueError(f"an interval list has an even length, got {len(flat)}")
        out = cls()
        for i in range(0, len(flat), 2):
            out.add_range(int(flat[i]), int(flat[i + 1]))
        return out

    def to_flat(self) -> list[int]:
        out: list[int] = []
        for lo, hi in zip(self._lo, self._hi):
            out += (lo, hi)
        return out

    def copy(self) -> IntervalSet:
        out = IntervalSet()
        out._lo, out._hi = list(self._lo), list(self._hi)
        return out

    def add(self, x: int) -> None:
        self.add_range(x, x + 1)

    def add_range(self, lo: int, hi: int) -> None:
        """Add ``[lo, hi)`` (merging with touching or overlapping intervals)."""
        if hi <= lo:
            return
        i = bisect_left(self._hi, lo)        # first interval that ends at or after lo
        j = bisect_right(self._lo, hi)       # intervals starting at or before hi
        if i < j:
            lo = min(lo, self._lo[i])
            hi = max(hi, self._hi[j - 1])
        self._lo[i:j] = [lo]
        self._hi[i:j] = [hi]

    def remove(self, x: int) -> None:
        self.remove_range(x, x + 1)

    def remove_range(self, lo: int, hi: int) -> None:
        """Remove ``[lo, hi)``."""
        if hi <= lo:
            return
        i = bisect_right(self._hi, lo)       # first interval ending after lo
        j = bisect_left(self._lo, hi)        # intervals starting before hi
        if i >= j:
            return
        new_lo: list[int] = []
        new_hi: list[int] = []
        if self._lo[i] < lo:
            new_lo.append(self._lo[i])
            new_hi.append(lo)
        if self._hi[j - 1] > hi:
            new_lo.append(hi)
            new_hi.append(self._hi[j - 1])
        self._lo[i:j] = new_lo
        self._hi[i:j] = new_hi

    # ------------------------------------------------------------- queries
    def __contains__(self, x: object) -> bool:
        if not isinstance(x, int):
            return False
        i = bisect_right(self._lo, x) - 1
        return i >= 0 and x < self._hi[i]

    def contains_range(self, lo: int, hi: int) -> bool:
        """Whether all of ``[lo, hi)`` is in the set (True for an empty range)."""
        if hi <= lo:
            return True
        i = bisect_right(self._lo, lo) - 1
        return i >= 0 and hi <= self._hi[i]

    def __len__(self) -> int:
        """How many integers (not intervals) the set holds."""
        return sum(h - l for l, h in zip(self._lo, self._hi))  # noqa: E741

    def __bool__(self) -> bool:
        return bool(self._lo)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IntervalSet) and self._lo == other._lo and \
            self._hi == other._hi

    def __repr__(self) -> str:
        return "IntervalSet(" + ", ".join(f"[{lo},{hi})" for lo, hi in self) + ")"

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """The intervals ``(lo, hi)`` in order."""
        return iter(zip(self._lo, self._hi))

    @property
    def num_intervals(self) -> int:
        return len(self._lo)

    def members(self) -> Iterator[int]:
        """Every integer in the set, ascending (O(size): for small sets only)."""
        for lo, hi in self:
            yield from range(lo, hi)

    # --------------------------------------------------------------- algebra
    def union(self, other: IntervalSet) -> IntervalSet:
        out = self.copy()
        for lo, hi in other:
            out.add_range(lo, hi)
        return out

    def intersection(self, other: IntervalSet) -> IntervalSet:
        out = IntervalSet()
        a, b = list(self), list(other)
        i = j = 0
        while i < len(a) and j < len(b):
            lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
            if lo < hi:
                out._lo.append(lo)
                out._hi.append(hi)
            if a[i][1] < b[j][1]:
                i += 1
            else:
                j += 1
        return out

    def difference(self, other: IntervalSet) -> IntervalSet:
        out = self.copy()
        for lo, hi in other:
            out.remove_range(lo, hi)
        return out
