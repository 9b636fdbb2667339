"""Admission and eviction of embedding rows (issue 29): effects on values, rows, memory,
checkpoints and exports, through the PS shard."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elasticdl.checkpoint import paths
from elasticdl.checkpoint import ps_shards as ps_ckpt
from elasticdl.common.tables import TableSpec
from elasticdl.ps import shard_checkpoint as shard_ckpt
from elasticdl.ps.admission import CountingSketch
from elasticdl.ps.eviction import EmbeddingDefaults
from elasticdl.ps.shard import GradientPush, PSShard, ShardConfig
from elasticdl.ps.slot_index import SlotIndex

DIM = 4
LR = 0.1
# a direct index (small table) and a sorted one (a 2^40-id table)
SIZES = [1000, 1 << 40]


def _opt(params):
    return torch.optim.Adagrad(params, lr=LR)


def _shard(spec: TableSpec, ckpt_dir: str = "", **cfg) -> PSShard:
    shard = PSShard(ShardConfig(checkpoint_dir=ckpt_dir, use_async=True, **cfg), _opt)
    shard.initialize(0, {}, {}, [spec])
    return shard


def _spec(num: int, **kw) -> TableSpec:
    return TableSpec("emb", num, DIM, initializer="normal:0.1", seed=3, **kw)


def _push(shard: PSShard, ids, value: float = 1.0) -> None:
    ids = np.asarray(ids, dtype=np.int64)
    shard.push_gradients(GradientPush(version=shard.version, sparse=[
        ("emb", ids, torch.full((ids.shape[0], DIM), value))]))


def _step(shard: PSShard, ids, value: float = 1.0) -> torch.Tensor:
    """A training step: pull (counts for admission), then push."""
    rows = shard.pull_embedding("emb", np.asarray(ids, dtype=np.int64))
    _push(shard, ids, value)
    return rows


def _adagrad_once(initial: torch.Tensor, g: float) -> torch.Tensor:
    grad = torch.full_like(initial, g)
    return initial - LR * grad / (grad * grad).sqrt().add(1e-10)


@pytest.mark.parametrize("num", SIZES)
def test_admission_default_value_no_row_no_update_until_nth_pull(num):
    spec = _spec(num, admit_after=3)
    shard = _shard(spec)
    t = shard.params.tables["emb"]
    ids = np.array([5, 17], dtype=np.int64)
    initial = spec.initial_rows(ids)
    for _ in range(2):   # seen twice: the initializer's rows, no row, gradients dropped
        assert torch.equal(_step(shard, ids, 5.0), initial)
        assert (t.find(ids) < 0).all() and t.live_rows == 0
    assert t.stats["grads_dropped"] == 4
    got = shard.pull_embedding("emb", ids)   # the third pull: rows, as they start
    assert torch.equal(got, initial) and (t.find(ids) >= 0).all()
    assert t.stats["admitted"] == 2
    _push(shard, ids, 1.0)
    assert torch.allclose(shard.pull_embedding("emb", ids), _adagrad_once(initial, 1.0))


def test_admission_off_by_default_and_job_default_applies():
    off = _shard(_spec(1000))
    off.pull_embedding("emb", np.array([1], dtype=np.int64))
    assert off.params.tables["emb"].live_rows == 1 and off.params.tables["emb"].sketch is None
    on = _shard(_spec(1000), embedding=EmbeddingDefaults(admit_after=2))
    on.pull_embedding("emb", np.array([1], dtype=np.int64))
    assert on.params.tables["emb"].live_rows == 0
    # the table's own setting wins over the job's
    mine = _shard(_spec(1000, admit_after=1), embedding=EmbeddingDefaults(admit_after=5))
    mine.pull_embedding("emb", np.array([1], dtype=np.int64))
    assert mine.params.tables["emb"].live_rows == 1


def test_sketch_is_bounded_and_never_undercounts():
    sketch = CountingSketch(1 << 12)
    ids = np.arange(1000, dtype=np.int64) * 7919
    for k in range(1, 4):
        assert (sketch.add(ids) >= k).all()
    for lo in range(0, 200_000, 1000):   # a long stream: the memory stays the same
        sketch.add(np.arange(lo, lo + 1000, dtype=np.int64) + (1 << 33))
    assert sketch.nbytes == 1 << 12


@pytest.mark.parametrize("num", SIZES)
def test_ttl_evicts_untouched_row_which_comes_back_fresh(num):
    spec = _spec(num, ttl_versions=3)
    shard = _shard(spec)
    t = shard.params.tables["emb"]
    a, b = np.array([10], dtype=np.int64), np.array([20], dtype=np.int64)
    _step(shard, [10, 20], 2.0)
    _step(shard, [10, 20], 3.0)
    slot_a = int(t.find(a)[0])
    for _ in range(3):
        _step(shard, b)
    assert t.find(a)[0] == -1 and t.find(b)[0] >= 0
    assert t.stats["evicted_ttl"] == 1 and t.live_rows == 1
    # it comes back as a new row: initial value, fresh Adagrad state, in the freed slot
    initial = spec.initial_rows(a)
    assert torch.equal(shard.pull_embedding("emb", a), initial)
    assert int(t.find(a)[0]) == slot_a
    assert float(t.state["sum"][slot_a].abs().sum()) == 0.0
    assert "step" not in t.state   # Adagrad without lr_decay keeps no update count
    _push(shard, a, 1.0)
    assert torch.allclose(shard.pull_embedding("emb", a), _adagrad_once(initial, 1.0))


@pytest.mark.parametrize("num", SIZES)
def test_capacity_bound_evicts_least_recently_updated(num):
    shard = _shard(_spec(num, max_rows=128))
    t = shard.params.tables["emb"]
    for i in range(128):   # row i last updated at version i + 1
        _step(shard, [i])
    _step(shard, [0])      # 0 is now the newest
    assert t.live_rows == 128
    _step(shard, [1000 % num + 500])   # one more: the 1 + 128 // 64 oldest go
    gone = np.flatnonzero(t.find(np.arange(128, dtype=np.int64)) < 0).tolist()
    assert gone == [1, 2, 3]
    rng = np.random.default_rng(0)
    for _ in range(40):
        _step(shard, np.unique(rng.integers(0, min(num, 10_000), 50)))
        assert t.live_rows <= 128 and t.size <= 128   # slots reused: the arena stays put
    assert t.stats["evicted_capacity"] > 0


def test_memory_bounded_over_a_drifting_stream():
    """The live ids shift; distinct ids seen grow 10x; the slots in use do not."""
    shard = _shard(_spec(1 << 40, ttl_versions=4), embedding=EmbeddingDefaults(
        sweep_rows=4096))
    t = shard.params.tables["emb"]
    for v in range(20):
        _step(shard, np.arange(v * 50, v * 50 + 500, dtype=np.int64))
    warm = t.size
    for v in range(20, 300):
        _step(shard, np.arange(v * 50, v * 50 + 500, dtype=np.int64))
        assert t.size <= warm + 250 and t.live_rows <= 500 + 4 * 50
    assert 299 * 50 + 500 >= 10 * (19 * 50 + 500)   # distinct ids seen: 10x the warm-up's


@pytest.mark.parametrize("num", SIZES)
def test_checkpoint_full_and_delta_drop_evicted_ids(tmp_path, num):
    ckpt_dir = str(tmp_path / "ckpt")
    spec = _spec(num, ttl_versions=3)
    shard = _shard(spec, ckpt_dir, full_checkpoint_every=4)
    t = shard.params.tables["emb"]
    _step(shard, [1, 2, 3, 4])
    shard_ckpt.save_shard(shard, ckpt_dir)            # whole: 1..4
    for _ in range(3):
        _step(shard, [3, 4, 5])                       # 1, 2 age out
    assert (t.find(np.array([1, 2])) < 0).all()
    _step(shard, [6])                                 # reuses a freed slot
    path = shard_ckpt.save_shard(shard, ckpt_dir)     # a delta
    delta = torch.load(path, weights_only=True)
    assert delta.get("delta") is not None
    assert sorted(delta["tables"]["emb"]["evicted"].tolist()) == [1, 2]
    for _ in range(3):
        _step(shard, [4, 5, 6])                       # 3 ages out
    shard_ckpt.save_shard(shard, ckpt_dir)            # another delta
    restored = PSShard(ShardConfig(), _opt)
    shard_ckpt.restore_shard(restored, paths.resolve(ckpt_dir))
    r = restored.params.tables["emb"]
    assert (r.find(np.array([1, 2, 3])) < 0).all() and r.live_rows == t.live_rows == 3
    live = np.array([4, 5, 6], dtype=np.int64)
    assert torch.equal(restored.pull_embedding("emb", live, create=False),
                       shard.pull_embedding("emb", live, create=False))
    for k in t.state:
        assert torch.equal(r.state[k].index_select(0, torch.from_numpy(r.find(live))),
                           t.state[k].index_select(0, torch.from_numpy(t.find(live))))
    rows = ps_ckpt.tables_of(ps_ckpt.load_shards(paths.resolve(ckpt_dir)))["emb"]
    assert sorted(rows["ids"].tolist()) == [4, 5, 6]


def test_exports_skip_evicted_ids(tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    shard = _shard(_spec(1 << 40, ttl_versions=2), ckpt_dir)
    _step(shard, [1, 2, 3])
    for _ in range(2):
        _step(shard, [3])
    pages = list(shard.export_rows("emb", 2))
    assert [i for page, _ in pages for i in page.tolist()] == [3]
    shard_ckpt.save_shard(shard, ckpt_dir)
    sparse = ps_ckpt.sparse_rows(paths.resolve(ckpt_dir), 0)["emb"]
    assert sparse.ids.tolist() == [3]


def test_sorted_index_remove_and_reinsert():
    index = SlotIndex(1 << 40, reserve=1 << 17)
    keys = np.arange(0, 1000, dtype=np.int64) * 3
    index.insert(keys, np.arange(1000, dtype=np.int64))
    index.remove(keys[:300])
    assert (index.find(keys[:300]) == -1).all()
    index.insert(keys[:10], np.arange(2000, 2010, dtype=np.int64))   # back, same keys
    index.remove(keys[300:700])                                      # compaction
    assert index.find(keys[:10]).tolist() == list(range(2000, 2010))
    assert (index.find(keys[10:700]) == -1).all()
    assert index.find(keys[700:]).tolist() == list(range(700, 1000))


def test_layer_arguments_reach_the_ps_table_policy_over_the_wire():
    from elasticdl.api.layers import Embedding, tables_on_ps
    from elasticdl.proto import elasticdl_pb2 as pb
    from elasticdl.ps.model_push import ModelPushes
    from elasticdl.worker.ps_model_push import table_info

    with tables_on_ps():   # no local weight
        layer = Embedding(1 << 30, DIM, initializer="zeros", admit_after=2, ttl_versions=7,
                          max_rows=100, ttl_seconds=30.5)
        plain = Embedding(1 << 30, DIM, initializer="zeros")
    shard = PSShard(ShardConfig(num_ps=2, ps_id=1, embedding=EmbeddingDefaults(
        ttl_versions=50, ttl_seconds=600)), _opt)
    ModelPushes(shard).push(pb.Model(version=0, embedding_tables=[
        table_info(layer.table_spec("a")), table_info(plain.table_spec("b"))]))
    a, b = shard.params.tables["a"].policy, shard.params.tables["b"].policy
    assert (a.admit_after, a.ttl_versions, a.max_rows, a.ttl_seconds) == (2, 7, 50, 30.5)
    assert (b.admit_after, b.ttl_versions, b.max_rows, b.ttl_seconds) == (1, 50, 0, 600)
    with pytest.raises(ValueError):
        Embedding(10, DIM, admit_after=0)
    with pytest.raises(ValueError):
        Embedding(10, DIM, ttl_seconds=-1.0)


def test_table_pushed_whole_evicts_to_zeros():
    rows = torch.arange(40, dtype=torch.float32).reshape(10, DIM) + 1
    spec = TableSpec("emb", 10, DIM, explicit=True, rows=rows, ttl_versions=2)
    shard = _shard(spec)
    t = shard.params.tables["emb"]
    for _ in range(2):
        _step(shard, [3])
    assert t.live_rows == 1 and t.find(np.array([3]))[0] >= 0
    assert torch.equal(shard.pull_embedding("emb", np.array([4]), create=False),
                       torch.zeros(1, DIM))


def test_sorted_index_compacts_a_step_at_a_time_and_finds_right_between_steps():
    rng = np.random.default_rng(1)
    index = SlotIndex(1 << 40, reserve=1 << 17)
    truth: dict[int, int] = {}
    next_slot = 0
    for round_ in range(60):
        new = np.setdiff1d(np.unique(rng.integers(0, 50_000, 400)) * 5,
                           np.array(list(truth), dtype=np.int64))
        index.insert(new, np.arange(next_slot, next_slot + new.shape[0], dtype=np.int64))
        truth.update(zip(new.tolist(), range(next_slot, next_slot + new.shape[0])))
        next_slot += new.shape[0]
        present = np.array(sorted(truth), dtype=np.int64)
        gone = rng.choice(present, size=present.shape[0] // 3, replace=False)
        index.remove(gone)
        for g in gone.tolist():
            del truth[g]
        for _ in range(3):
            index.compact_step(97)   # a few small steps, then more changes
        probe = np.concatenate([np.array(sorted(truth), dtype=np.int64), gone])
        want = np.array([truth.get(int(k), -1) for k in probe])
        assert np.array_equal(index.find(probe), want), round_
    while index.compact_step(1000):
        pass
    assert index._n <= 4 * len(truth) // 3 + 1


def test_job_flags_reach_the_shard_config():
    from elasticdl.common.job_spec import job_spec_from_flags
    from elasticdl.ps.main import PSArgs, shard_config

    job = job_spec_from_flags("train", {
        "model_zoo": "z", "model_def": "m.f", "training_data": "d",
        "distribution_strategy": "ParameterServerStrategy", "embedding_admit_after": "3",
        "embedding_ttl_versions": "40", "embedding_max_rows": "1000",
        "embedding_admission_counters": "4096", "embedding_evict_sweep_rows": "512",
        "embedding_ttl_seconds": "86400"})
    cfg = shard_config(PSArgs(ps_id=0, num_ps=2, port=0, job_spec=job))
    assert cfg.embedding == EmbeddingDefaults(admit_after=3, ttl_versions=40, max_rows=1000,
                                              sketch_counters=4096, sweep_rows=512,
                                              ttl_seconds=86400.0)
    assert cfg.embedding.policy(None, None, None, 2).max_rows == 500


def test_restore_of_more_rows_than_the_bound_then_new_rows_evict_the_excess(tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    unbounded = _shard(_spec(1 << 40), ckpt_dir)
    _step(unbounded, np.arange(300, dtype=np.int64))
    shard_ckpt.save_shard(unbounded, ckpt_dir)
    bounded = PSShard(ShardConfig(embedding=EmbeddingDefaults(max_rows=100)), _opt)
    shard_ckpt.restore_shard(bounded, paths.resolve(ckpt_dir))
    t = bounded.params.tables["emb"]
    assert t.live_rows == 300
    bounded.pull_embedding("emb", np.array([10_000], dtype=np.int64))
    assert t.live_rows <= 100 and t.find(np.array([10_000]))[0] >= 0
