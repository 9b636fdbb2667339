"""The compact row store: rows over reserved address space, an index merged in place."""

from __future__ import annotations

import os

import numpy as np
import torch

from elasticdl.common.tables import TableSpec
from elasticdl.ps import row_arena
from elasticdl.ps.parameters import EmbeddingTable
from elasticdl.ps.slot_index import SlotIndex


def test_merge_into_keeps_keys_sorted_and_values_aligned():
    rng = np.random.default_rng(0)
    keys = np.zeros(5000, dtype=np.int64)
    values = np.zeros(5000, dtype=np.int32)
    n = 0
    ref: dict[int, int] = {}
    for _ in range(20):
        new = np.setdiff1d(np.unique(rng.integers(0, 100_000, size=200)),
                           np.array(list(ref), dtype=np.int64))
        vals = rng.integers(0, 1 << 30, size=new.shape[0])
        n = row_arena.merge_into(keys, values, n, new, vals, chunk=37)
        ref.update(zip(new.tolist(), vals.tolist()))
    assert n == len(ref)
    assert keys[:n].tolist() == sorted(ref)
    assert values[:n].tolist() == [ref[k] for k in sorted(ref)]


def test_index_in_place_and_after_its_reserve_agree():
    rng = np.random.default_rng(1)
    ids = np.unique(rng.integers(0, 1 << 40, size=3000))
    rng.shuffle(ids)
    small = SlotIndex(1 << 40, reserve=1 << 16)   # in place
    tight = SlotIndex(1 << 40, reserve=1 << 16)
    tight._keys, tight._values = tight._keys[:1000], tight._values[:1000]  # then np.insert
    for lo in range(0, ids.shape[0], 500):
        part = ids[lo:lo + 500]
        for index in (small, tight):
            index.insert(part, np.arange(lo, lo + part.shape[0]))
    probe = np.concatenate([ids, ids + 1])
    expected = np.concatenate([np.arange(ids.shape[0]), np.full(ids.shape[0], -1)])
    expected[ids.shape[0]:][np.isin(ids + 1, ids)] = -2   # (a neighbour that exists)
    for index in (small, tight):
        found = index.find(probe)
        assert found.dtype == np.int64
        mask = expected != -2
        assert np.array_equal(found[mask], expected[mask])


def test_a_big_insert_sorted_by_torch_finds_every_id():
    """An insert from ``TORCH_SORT_MIN`` ids on (a restore's) sorts with torch; read-only
    ids (a mapped checkpoint) are copied, not written."""
    from elasticdl.ps import slot_index

    rng = np.random.default_rng(2)
    ids = np.unique(rng.integers(0, 1 << 40, size=3 * slot_index.TORCH_SORT_MIN))
    rng.shuffle(ids)
    first, second = ids[:slot_index.TORCH_SORT_MIN], ids[slot_index.TORCH_SORT_MIN:]
    second.flags.writeable = False
    index = SlotIndex(1 << 40, reserve=1 << 17)
    index.insert(first, np.arange(first.shape[0]))
    index.insert(second, np.arange(first.shape[0], ids.shape[0]))
    assert np.array_equal(index.find(ids), np.arange(ids.shape[0]))
    assert index.find(np.array([int(ids.max()) + 1]))[0] == -1


def test_a_big_lazy_table_grows_without_copying_and_keeps_its_rows():
    spec = TableSpec("emb", 1 << 40, 4, initializer="normal:0.01")
    t = EmbeddingTable(spec, 0, 1)
    assert t._reserved > 0, "the reservation was refused here"
    t.ensure_state("sum", 0.5)
    weights = t.weights
    ids = np.arange(0, 300_000, dtype=np.int64) * 11
    for lo in range(0, ids.shape[0], 70_000):
        t.slots(ids[lo:lo + 70_000])
    assert t.weights is weights and t.size == ids.shape[0]          # never moved
    assert torch.equal(t.state["sum"][:t.size], torch.full((t.size, 4), 0.5))
    assert torch.equal(t.lookup(ids[::7], create=False), spec.initial_rows(ids[::7]))
    # out of reserved space: ordinary tensors from then on, the same rows
    before = t.lookup(ids, create=False)
    t._leave_arena(t.size + 10)
    assert t._reserved == 0 and t.weights is not weights
    assert torch.equal(t.lookup(ids, create=False), before)
    more = np.arange(300_000, 300_100, dtype=np.int64) * 11
    t.slots(more)
    assert torch.equal(t.state["sum"][t.size - 100:t.size], torch.full((100, 4), 0.5))


def test_release_hands_the_pages_back_and_leaves_other_tensors_alone():
    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    t = row_arena.buffer(1 << 20, (16,), torch.float32)   # 64 MiB over a mapping
    t.fill_(1.0)
    plain = torch.ones(1000)
    before = rss_mb()
    row_arena.release(t, plain, t[10:])   # a view that does not start the mapping: skipped
    assert before - rss_mb() > 48   # its pages went back
    assert float(t.abs().sum()) == 0.0   # (and read as zeros: it is dropped next)
    assert float(plain.sum()) == 1000.0
    small = row_arena.buffer(16, (4,), torch.float32)   # heap memory: never released
    small.fill_(2.0)
    row_arena.release(small)
    assert float(small.sum()) == 128.0
