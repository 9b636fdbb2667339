"""Checkpoints in object storage written by pods that share no disk (Kubernetes): each PS
stages its own shard and uploads it; the version is complete in the bucket only once every
shard is up (the last PS writes ``DONE``); the master sees complete versions as their small
files; a relaunched PS restores from the bucket bringing only its own shard chain; the
staging directories stay bounded. The store is a local directory behind the file-system
layer's own pyarrow wrapper, reached as ``s3://`` URLs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from elasticdl.checkpoint import api as ckpt_api
from elasticdl.checkpoint import remote, staging
from elasticdl.checkpoint.mirror import CheckpointMirror
from elasticdl.checkpoint.paths import DONE, complete_versions
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.tables import TableSpec
from elasticdl.ps import shard_checkpoint as shard_ckpt
from elasticdl.ps.push import GradientPush
from elasticdl.ps.shard import PSShard, ShardConfig

URL = "s3://ckpt/job"


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """``s3://`` URLs served from ``tmp_path/store``; returns that directory."""
    import fsspec
    import pyarrow.fs as pafs
    from fsspec.implementations.arrow import ArrowFSWrapper

    from elasticdl.data import fs

    store = str(tmp_path / "store")
    local_fs = ArrowFSWrapper(pafs.PyFileSystem(pafs.FSSpecHandler(
        fsspec.filesystem("file", auto_mkdir=True))))
    monkeypatch.setattr(fs, "filesystem",
                        lambda url: (local_fs, os.path.join(store, url.split("://", 1)[1])))
    yield store
    staging.stop_all()


def _shard(ps_id: int, ckpt_dir: str, full_every: int = 2) -> PSShard:
    shard = PSShard(ShardConfig(ps_id=ps_id, num_ps=2, checkpoint_dir=ckpt_dir, use_async=True,
                                full_checkpoint_every=full_every),
                    lambda p: torch.optim.Adagrad(p, lr=0.1))
    shard.initialize(0, {}, {}, [TableSpec("emb", 1 << 40, 4, initializer="normal:0.01")])
    return shard


def _train(shard: PSShard, k: int) -> None:
    ids = (np.arange(50 * (k + 1), dtype=np.int64) * 2 + shard.config.ps_id)
    shard.pull_embedding("emb", ids)
    shard.push_gradients(GradientPush(version=shard.version,
                                      sparse=[("emb", ids, torch.ones(len(ids), 4))]))


def _rows(shard: PSShard) -> tuple[torch.Tensor, torch.Tensor]:
    t = shard.params.tables["emb"]
    order = np.argsort(t.row_ids[:t.size])
    return (torch.from_numpy(t.row_ids[:t.size][order].copy()),
            t.weights[:t.size][torch.from_numpy(order)])


def _objects(store: str, version: int) -> list[str]:
    vdir = os.path.join(store, "ckpt", "job", f"version-{version}")
    return sorted(os.listdir(vdir)) if os.path.isdir(vdir) else []


def test_pods_complete_versions_in_the_bucket_and_a_relaunched_ps_restores_its_shard(
        bucket, tmp_path):
    stages = [str(tmp_path / f"ps-{i}") for i in range(2)]
    master_dir = str(tmp_path / "master")
    for d in (*stages, master_dir):
        os.makedirs(d)
    shards = [_shard(i, stages[i]) for i in range(2)]
    mirrors = [CheckpointMirror(d, URL, keep_max=2, prune_local=True) for d in stages]
    master = CheckpointMirror(master_dir, URL, observe=True)
    for k in range(6):
        for s in shards:
            _train(s, k)
        v = k + 1
        shard_ckpt.save_shard(shards[0], stages[0], v, keep_max=2)
        assert mirrors[0].sync() == []             # PS 1's shard is not up yet: no DONE
        assert "ps-0-of-2.pt" in _objects(bucket, v) and DONE not in _objects(bucket, v)
        assert not remote.remote_versions(URL) or remote.remote_versions(URL)[-1] < v
        shard_ckpt.save_shard(shards[1], stages[1], v, keep_max=2)
        assert not os.path.exists(os.path.join(stages[1], f"version-{v}", DONE))  # 1 of 2
        assert mirrors[1].sync() == [v]            # the last PS up writes DONE
        assert remote.remote_versions(URL)[-1] == v
        assert mirrors[0].sync() == [v]            # it learns the version is complete
        master.sync()
        # the master's view: complete, its data positions, no shard
        assert complete_versions(master_dir)[-1] == v
        names = sorted(os.listdir(os.path.join(master_dir, f"version-{v}")))
        assert not [n for n in names if n.endswith(".pt")], names
    # retention in the bucket: the newest 2 and what their deltas are folded onto (every
    # 2nd checkpoint whole: 5 whole, 6 a delta of it)
    assert remote.remote_versions(URL) == [5, 6]
    assert sorted(os.listdir(os.path.join(bucket, "ckpt", "job"))) == ["version-5",
                                                                       "version-6"]
    # the master drops what the bucket dropped; each PS keeps only what its chain needs
    assert complete_versions(master_dir) == [5, 6]
    for d in stages:
        assert sorted(os.listdir(d)) == ["version-5", "version-6"], os.listdir(d)

    # PS 1 relaunched in a fresh pod: the newest version's small files first, then only
    # its own shard chain (6 is a delta of 5)
    spec = JobSpec(model_zoo="z", model_def="m.f", training_data="/d", checkpoint_dir=URL,
                   image_name="reg/x:1", keep_checkpoint_max=2,
                   distribution_strategy="ParameterServerStrategy")
    assert spec.cluster == "k8s"
    staged = staging.stage(spec, str(tmp_path / "relaunched"), pod=True)
    local = staged.checkpoint_dir
    assert complete_versions(local) == [6]
    assert not [n for n in os.listdir(os.path.join(local, "version-6")) if n.endswith(".pt")]
    fresh = PSShard(ShardConfig(ps_id=1, num_ps=2, checkpoint_dir=local, use_async=True),
                    lambda p: torch.optim.Adagrad(p, lr=0.1))
    source = ckpt_api.latest(local)
    assert shard_ckpt.restore_shard(fresh, source) == 6
    got, want = _rows(fresh), _rows(shards[1])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for v in (5, 6):
        pts = [n for n in os.listdir(os.path.join(local, f"version-{v}")) if n.endswith(".pt")]
        assert pts == ["ps-1-of-2.pt"], (v, pts)   # PS 0's shard never came down
    # a rollback's version directory travels as a URL
    assert staging.to_url(source) == f"{URL}/version-6"
    assert staging.to_local(f"{URL}/version-6") == source
    with pytest.raises(Exception, match="not under this job's checkpoint URLs"):
        staging.to_local("s3://other/version-6")
    assert staging.for_children(staged).checkpoint_dir == URL

    # a rollback may name an older version than the newest (--restore_from, as a URL):
    # a PS relaunched into a fresh pod brings it down before checking its DONE (a CI run
    # failed 11 relaunches of a PS with "version-95 is incomplete (no DONE marker)")
    staging.stop_all()   # that pod is gone
    older = staging.stage(spec, str(tmp_path / "relaunched-older"), pod=True)
    named = staging.to_local(f"{URL}/version-5")
    assert not os.path.exists(os.path.join(named, DONE))
    fresh5 = PSShard(ShardConfig(ps_id=1, num_ps=2, checkpoint_dir=older.checkpoint_dir,
                                 use_async=True), lambda p: torch.optim.Adagrad(p, lr=0.1))
    assert shard_ckpt.restore_from(fresh5, named) == 5
    assert fresh5.params.tables["emb"].live_rows == 50 * 5   # 5 steps of its rows


def test_an_abandoned_version_never_completes_and_retention_removes_it(bucket, tmp_path):
    """A PS lost before writing its shard: the version stays without DONE in the bucket, a
    reader resumes from the one before, and once newer versions are complete retention
    deletes it with the old complete ones."""
    stages = [str(tmp_path / f"ps-{i}") for i in range(2)]
    shards = [_shard(i, stages[i], full_every=1) for i in range(2)]
    mirrors = [CheckpointMirror(d, URL, prune_local=True, keep_max=1) for d in stages]
    for s, d in zip(shards, stages):
        _train(s, 0)
        shard_ckpt.save_shard(s, d, 1)
    assert mirrors[0].sync() == [] and mirrors[1].sync() == [1]
    _train(shards[0], 1)
    shard_ckpt.save_shard(shards[0], stages[0], 2)
    assert mirrors[0].sync() == [1]        # 1 learnt complete; 2 waits for PS 1's shard
    assert remote.remote_versions(URL) == [1]
    assert _objects(bucket, 2) == ["ps-0-of-2.pt"]   # PS 0 alone wrote it
    got = remote.download_checkpoint(URL, str(tmp_path / "down"))
    assert complete_versions(got) == [1]
    for s, d in zip(shards, stages):
        _train(s, 2)
        shard_ckpt.save_shard(s, d, 3)
    assert mirrors[0].sync() == [] and mirrors[1].sync() == [3]
    assert sorted(os.listdir(os.path.join(bucket, "ckpt", "job"))) == ["version-3"]
