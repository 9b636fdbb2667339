"""IntervalSet against a plain Python set under random operations."""

import random

import pytest

from elasticdl.common.intervals import IntervalSet


def _as_set(s: IntervalSet) -> set[int]:
    return set(s.members())


def test_random_ops_match_a_plain_set():
    rng = random.Random(7)
    for _ in range(200):
        s, ref = IntervalSet(), set()
        for _ in range(60):
            lo = rng.randrange(0, 80)
            hi = lo + rng.randrange(0, 12)
            if rng.random() < 0.6:
                s.add_range(lo, hi)
                ref |= set(range(lo, hi))
            else:
                s.remove_range(lo, hi)
                ref -= set(range(lo, hi))
            assert _as_set(s) == ref
            assert len(s) == len(ref)
            # disjoint, non-adjacent, sorted
            flat = s.to_flat()
            assert all(flat[i] < flat[i + 1] for i in range(len(flat) - 1))
            x = rng.randrange(-2, 95)
            assert (x in s) == (x in ref)
            a, b = rng.randrange(0, 90), rng.randrange(0, 12)
            assert s.contains_range(a, a + b) == set(range(a, a + b)).issubset(ref)
        assert IntervalSet.from_flat(s.to_flat()) == s


def test_algebra():
    rng = random.Random(3)
    for _ in range(100):
        sets = []
        for _ in range(2):
            s = IntervalSet()
            for _ in range(10):
                lo = rng.randrange(0, 60)
                s.add_range(lo, lo + rng.randrange(1, 8))
            sets.append(s)
        a, b = sets
        assert _as_set(a.union(b)) == _as_set(a) | _as_set(b)
        assert _as_set(a.intersection(b)) == _as_set(a) & _as_set(b)
        assert _as_set(a.difference(b)) == _as_set(a) - _as_set(b)


def test_in_order_completion_stays_one_interval():
    s = IntervalSet()
    for t in range(100_000):
        s.add(t)
    assert s.num_intervals == 1 and len(s) == 100_000


def test_bad_flat_list():
    with pytest.raises(ValueError, match="even length"):
        IntervalSet.from_flat([1, 2, 3])
