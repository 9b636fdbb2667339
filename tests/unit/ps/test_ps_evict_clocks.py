"""Eviction clocks (issue 29): a time-to-live in seconds (rows not updated for that long
are evicted, rows updated since are kept, with no per-row clock: the rows' last-update
versions and a bounded record of when versions began), and the rows' last-update
versions kept by checkpoints, so a PS restored more often than its TTL still evicts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elasticdl.checkpoint import paths
from elasticdl.ps import shard_checkpoint as shard_ckpt
from elasticdl.ps.eviction import VersionClock
from elasticdl.ps.shard import PSShard, ShardConfig
from tests.unit.ps.test_ps_evict import SIZES, _opt, _shard, _spec, _step


class FakeTime:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_clock_cut_is_the_newest_version_begun_ttl_ago_and_never_too_early():
    now = FakeTime()
    clock = VersionClock(10.0, resolution=10, clock=now)
    for v in range(100):           # a version a second
        clock.mark(v)
        if v < 10:
            assert clock.cut() is None   # nothing is 10 s old yet
        else:
            cut = clock.cut()
            assert cut is not None and v - 10 - 1 <= cut <= v - 10, (v, cut)
        now.t += 1.0
    # a version in well under the gap (1 s): not kept, bounded whatever the job's length
    for v in range(100, 100_000):
        now.t += 0.001
        clock.mark(v)
    assert len(clock.marks) <= 10 + 2
    cut = clock.cut()
    assert cut is not None
    began = {v: 1000.0 + 100 + (v - 99) * 0.001 for v in range(100, 100_000)}
    assert began[cut] <= now.t - 10.0 < began[cut] + 1.0 + 0.001   # late by <= one gap


def test_clock_forgets_versions_a_rollback_took_back():
    now = FakeTime()
    clock = VersionClock(5.0, resolution=5, clock=now)
    for v in range(20):
        clock.mark(v)
        now.t += 1.0
    clock.mark(8)                 # the PS rolled back to version 8
    assert [v for v, _ in clock.marks][-1] == 8 and all(
        v <= 8 for v, _ in clock.marks)
    # the marks of versions 8..19 are void: none old enough is left, nothing is evicted
    # by time until version 8's mark is 5 s old
    assert clock.cut() is None and clock.ttl_versions(8) == 0
    now.t += 5.0
    clock.mark(9)
    assert clock.cut() == 8 and clock.ttl_versions(9) == 2


@pytest.mark.parametrize("num", SIZES)
def test_ttl_seconds_evicts_rows_not_updated_for_that_long_only(num):
    shard = _shard(_spec(num, ttl_seconds=10.0))
    t = shard.params.tables["emb"]
    now = FakeTime()
    t.clock = VersionClock(10.0, clock=now)   # the table's, on a clock the test moves
    t.clock.mark(t.now)
    _step(shard, [10, 20, 30])            # three rows at t = 0
    evicted_at = None
    for second in range(1, 40):
        now.t += 1.0
        _step(shard, [20] if second < 25 else [20, 30])   # 20 always, 30 from t = 25
        if evicted_at is None and t.find(np.array([10]))[0] == -1:
            evicted_at = second
    # 10 goes once it is 10 s old (a sweep a version), not a second before
    assert evicted_at is not None and 10 <= evicted_at <= 11, evicted_at
    assert t.find(np.array([20]))[0] >= 0          # updated every second: kept
    assert t.find(np.array([30]))[0] >= 0          # back at 25 as a fresh row
    assert t.stats["evicted_ttl"] == 2             # 10, and 30 (idle 1..24)


def test_either_ttl_evicts():
    shard = _shard(_spec(1 << 40, ttl_seconds=3600.0, ttl_versions=3))
    t = shard.params.tables["emb"]
    _step(shard, [10, 20])
    for _ in range(3):
        _step(shard, [20])
    assert t.find(np.array([10]))[0] == -1 and t.stats["evicted_ttl"] == 1


@pytest.mark.parametrize("num", SIZES)
@pytest.mark.parametrize("num_ps", [1, 2])   # the same layout, and re-sharded (1 -> 2 PS)
def test_row_clocks_survive_a_restore_from_a_whole_checkpoint_and_its_delta(tmp_path, num,
                                                                             num_ps):
    """Row 10 idle since version 0, TTL 5 versions: it goes at version 5 whether or not
    the PS was restored at version 4 (before, a restore restarted every row's clock:
    evicted at 9, and never in a job whose PS restarts more often than its TTL)."""
    ckpt_dir = str(tmp_path / "ckpt")
    shard = _shard(_spec(num, ttl_versions=5), ckpt_dir, full_checkpoint_every=4)
    _step(shard, [10, 20])                      # both stamped 0; version 1
    for _ in range(2):
        _step(shard, [20])                      # version 3
    shard_ckpt.save_shard(shard, ckpt_dir)      # whole
    _step(shard, [20])                          # version 4
    path = shard_ckpt.save_shard(shard, ckpt_dir)   # a delta (10 not in it)
    assert torch.load(path, weights_only=True).get("delta") is not None
    restored = PSShard(ShardConfig(num_ps=num_ps, ps_id=0, use_async=True), _opt)
    shard_ckpt.restore_shard(restored, paths.resolve(ckpt_dir))
    t, r = shard.params.tables["emb"], restored.params.tables["emb"]
    ids = np.array([10, 20], dtype=np.int64)
    assert r.touched is not None and t.touched is not None
    assert r.touched[r.find(ids)].tolist() == t.touched[t.find(ids)].tolist() == [0, 3]
    for s in (shard, restored):
        assert s.params.tables["emb"].find(ids[:1])[0] >= 0     # age 4: kept
        _step(s, [20])                                          # version 5: age 5
        assert s.params.tables["emb"].find(ids[:1])[0] == -1, s.version
        assert s.params.tables["emb"].find(ids[1:])[0] >= 0


def test_a_checkpoint_without_clocks_restores_rows_as_updated_at_the_restore(tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    shard = _shard(_spec(1 << 40), ckpt_dir)    # no eviction: no clocks in the file
    _step(shard, [10, 20])
    _step(shard, [20])
    shard_ckpt.save_shard(shard, ckpt_dir)
    restored = PSShard(ShardConfig(use_async=True, embedding=shard.config.embedding.__class__(
        ttl_versions=3)), _opt)
    shard_ckpt.restore_shard(restored, paths.resolve(ckpt_dir))
    r = restored.params.tables["emb"]
    assert r.touched is not None and r.touched[r.find(np.array([10]))].tolist() == [2]
