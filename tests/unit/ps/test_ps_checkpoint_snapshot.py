"""Checkpoints that do not stop training, and incremental ones (issue 29).

The effect, not the bookkeeping: a checkpoint cut while another thread pushes restores to
exactly the state of the pushes its ledger holds (every row's weights and Adagrad state
from one moment, replayed on a reference shard); whole + deltas restore to the live
shard's state at the last delta; every reader of the files sees whole tables.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from elasticdl.checkpoint import ps_shards as ps_ckpt
from elasticdl.checkpoint import single as ckpt
from elasticdl.common.tables import TableSpec
from elasticdl.ps import row_snapshot
from elasticdl.ps import shard_checkpoint as shard_ckpt
from elasticdl.ps.eviction import EmbeddingDefaults
from elasticdl.ps.shard import GradientPush, PSShard, ShardConfig

ROWS = 20_000
DIM = 4
# a table that evicts keeps no dirty marks (its last-update versions say which rows are
# a delta's): the same effects with eviction on (a TTL nothing reaches)
POLICIES = [{}, {"embedding": EmbeddingDefaults(ttl_versions=1 << 30)}]


def _opt(params):
    return torch.optim.Adagrad(params, lr=0.1)


def _shard(ckpt_dir: str = "", **cfg) -> PSShard:
    return PSShard(ShardConfig(checkpoint_dir=ckpt_dir, use_async=True, **cfg), _opt)


def _init(shard: PSShard) -> None:
    shard.initialize(0, {"w": torch.zeros(3)}, {}, [TableSpec("emb", 1 << 40, DIM,
                                                               initializer="normal:0.01")])
    shard.pull_embedding("emb", np.arange(ROWS, dtype=np.int64) * 7)   # rows in slot order


def _push(shard: PSShard, task: int, k: int) -> None:
    """Push ``(task, k)``: its rows and gradient follow from its identity alone."""
    rng = np.random.default_rng(task * 100_003 + k)
    ids = np.unique(rng.integers(0, ROWS + 200, size=500)) * 7   # a few new rows too
    grad = torch.from_numpy(rng.standard_normal((ids.shape[0], DIM)).astype(np.float32))
    shard.push_gradients(GradientPush(version=shard.version, task_id=task, minibatch=k,
                                      num_records=1, dense={"w": torch.full((3,), 0.5)},
                                      sparse=[("emb", ids, grad)]))


def _rows(shard: PSShard) -> dict[str, torch.Tensor]:
    """Every row of the table by id, with its optimizer state, and the dense state."""
    t = shard.params.tables["emb"]
    order = torch.from_numpy(np.argsort(t.row_ids[:t.size], kind="stable"))
    out = {"ids": torch.from_numpy(np.sort(t.row_ids[:t.size])),
           "weights": t.weights[:t.size].index_select(0, order),
           "w": shard.params.dense["w"].detach().clone()}
    for k, v in t.state.items():
        out[k] = v[:t.size].index_select(0, order)
    assert shard.optimizer is not None
    out["w_sum"] = shard.optimizer.state_dict()["state"][0]["sum"].clone()
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _restore(vdir: str) -> PSShard:
    shard = _shard()
    shard_ckpt.restore_shard(shard, vdir)
    return shard


@pytest.mark.parametrize("cfg", POLICIES, ids=["marks", "stamps"])
def test_checkpoint_cut_while_another_thread_pushes_is_one_moment(tmp_path, monkeypatch, cfg):
    monkeypatch.setattr(row_snapshot, "CHUNK_ROWS", 256)   # ~80 chunks: pushes interleave
    copied_ahead = []
    preserve = row_snapshot.TableSnapshot.preserve

    def counting(self, slots):
        n = preserve(self, slots)
        copied_ahead.append(n)
        return n

    monkeypatch.setattr(row_snapshot.TableSnapshot, "preserve", counting)
    live = _shard(str(tmp_path), **cfg)
    _init(live)
    for k in range(1, 6):
        _push(live, 1, k)
    stop = threading.Event()

    def pusher():
        k = 0
        while not stop.is_set():
            k += 1
            _push(live, 2, k)

    thread = threading.Thread(target=pusher)
    thread.start()
    try:
        paths = [shard_ckpt.save_shard(live, str(tmp_path)) for _ in range(3)]  # whole, deltas
        last_cut = live.last_checkpoint_version
        deadline = time.monotonic() + 30
        while live.version <= last_cut and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join()
    assert sum(copied_ahead) > 0, "no push landed on a row the copy had not reached yet"
    for path in paths:
        restored = _restore(os.path.dirname(path))
        _, entries = restored.applied()
        # the reference: the pushes the restored ledger holds, replayed in their order
        ref = _shard()
        _init(ref)
        for task, k, _, _ in sorted(entries, key=lambda e: e[3]):
            _push(ref, task, k)
        assert ref.version == restored.version
        _assert_same(_rows(restored), _rows(ref))
    assert live.version > restored.version   # pushes went on after the last cut


@pytest.mark.parametrize("cfg", POLICIES, ids=["marks", "stamps"])
def test_whole_plus_deltas_restore_the_live_state(tmp_path, cfg):
    ckpt_dir = str(tmp_path)
    live = _shard(ckpt_dir, full_checkpoint_every=3, **cfg)
    _init(live)
    sizes, kinds, states = [], [], []
    task = 0
    for _ in range(5):
        for k in range(1, 4):
            _push(live, task, k)
        task += 1
        path = shard_ckpt.save_shard(live, ckpt_dir)
        sizes.append(os.path.getsize(path))
        kinds.append("delta" if torch.load(path, weights_only=True).get("delta") else "whole")
        states.append((os.path.dirname(path), _rows(live), live.applied()))
    assert kinds == ["whole", "delta", "delta", "whole", "delta"], kinds
    assert max(sizes[1], sizes[2], sizes[4]) < 0.2 * sizes[0], sizes
    for vdir, rows, applied in states:
        restored = _restore(vdir)
        _assert_same(_rows(restored), rows)
        assert restored.applied() == applied
    # every reader sees whole tables: the plain export and the sparse rows
    vdir, rows, _ = states[2]
    t = ps_ckpt.sparse_rows(vdir, 0)["emb"]
    assert torch.equal(torch.as_tensor(t.ids), rows["ids"])
    assert torch.equal(t.values, rows["weights"])


def test_retention_keeps_the_versions_a_delta_needs(tmp_path):
    ckpt_dir = str(tmp_path)
    live = _shard(ckpt_dir, full_checkpoint_every=4, keep_checkpoint_max=2)
    _init(live)
    versions = []
    for task in range(6):
        _push(live, task, 1)
        path = shard_ckpt.save_shard(live, ckpt_dir, keep_max=2)
        versions.append(ckpt.version_of(os.path.dirname(path)))
    # whole at 1 and 5 (of 6): the two newest (5, 6) need only 5 on
    assert ckpt.complete_versions(ckpt_dir) == versions[4:]
    _push(live, 9, 1)
    shard_ckpt.save_shard(live, ckpt_dir, keep_max=1)   # a delta of 5's chain
    kept = ckpt.complete_versions(ckpt_dir)
    assert kept[0] == versions[4] and len(kept) == 3, kept
    _assert_same(_rows(_restore(ckpt.version_dir(ckpt_dir, kept[-1]))), _rows(live))


def test_a_restored_shard_starts_with_a_whole_checkpoint(tmp_path):
    ckpt_dir = str(tmp_path)
    live = _shard(ckpt_dir)
    _init(live)
    _push(live, 1, 1)
    first = shard_ckpt.save_shard(live, ckpt_dir)
    _push(live, 1, 2)
    shard_ckpt.save_shard(live, ckpt_dir)
    restored = _shard(ckpt_dir)
    shard_ckpt.restore_shard(restored, os.path.dirname(first))
    _push(restored, 1, 3)
    again = shard_ckpt.save_shard(restored, ckpt_dir, version=50)
    assert "delta" not in torch.load(again, weights_only=True)


def test_a_missing_link_of_the_chain_is_named(tmp_path):
    ckpt_dir = str(tmp_path)
    live = _shard(ckpt_dir)
    _init(live)
    _push(live, 1, 1)
    first = shard_ckpt.save_shard(live, ckpt_dir)
    _push(live, 1, 2)
    second = shard_ckpt.save_shard(live, ckpt_dir)
    os.remove(first)
    with pytest.raises(ckpt.CheckpointError, match="is a delta of version"):
        ps_ckpt.load_shards(os.path.dirname(second))
