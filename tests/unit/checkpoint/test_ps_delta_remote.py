"""PS delta checkpoints through the object-storage mirror (a local directory as the store):
bucket retention keeps what a kept delta is folded onto, a download brings it."""

from __future__ import annotations

import os

import numpy as np
import torch

from elasticdl.checkpoint import ps_shards, remote
from elasticdl.checkpoint.mirror import CheckpointMirror
from elasticdl.checkpoint.paths import complete_versions, version_dir
from elasticdl.common.tables import TableSpec
from elasticdl.ps import shard_checkpoint as shard_ckpt
from elasticdl.ps.push import GradientPush
from elasticdl.ps.shard import PSShard, ShardConfig


def test_a_delta_in_the_bucket_keeps_and_brings_its_whole_checkpoint(tmp_path, monkeypatch):
    import fsspec
    import pyarrow.fs as pafs
    from fsspec.implementations.arrow import ArrowFSWrapper

    from elasticdl.data import fs

    # the store: a local directory behind a pyarrow file system, as the layer's are (its
    # parents made on write, as keys need none)
    local_fs = ArrowFSWrapper(pafs.PyFileSystem(pafs.FSSpecHandler(
        fsspec.filesystem("file", auto_mkdir=True))))
    monkeypatch.setattr(fs, "filesystem", lambda url: (local_fs, url))
    local, bucket, down = (str(tmp_path / n) for n in ("local", "bucket", "down"))
    shard = PSShard(ShardConfig(checkpoint_dir=local, use_async=True),
                    lambda p: torch.optim.Adagrad(p, lr=0.1))
    shard.initialize(0, {}, {}, [TableSpec("emb", 1 << 40, 4, initializer="normal:0.01")])
    ids = np.arange(1000, dtype=np.int64) * 3
    mirror = CheckpointMirror(local, bucket, keep_max=1)
    for k in range(3):
        part = ids[:100 * (k + 1)]
        shard.pull_embedding("emb", part)
        shard.push_gradients(GradientPush(version=shard.version,
                                          sparse=[("emb", part, torch.ones(len(part), 4))]))
        shard_ckpt.save_shard(shard, local, keep_max=1)
        mirror.sync()
    assert complete_versions(local) == complete_versions(bucket) == [1, 2, 3]  # 1: whole
    vdir = remote.download_checkpoint(os.path.join(bucket, "version-3"), down)
    assert sorted(os.listdir(down)) == ["version-1", "version-2", "version-3"]
    mine = ps_shards.load_shards(vdir)[0]["tables"]["emb"]
    t = shard.params.tables["emb"]
    assert torch.equal(mine["ids"], torch.from_numpy(t.row_ids[:t.size].copy()))
    assert torch.equal(mine["weights"], t.weights[:t.size])
    assert torch.equal(mine["state"]["sum"], t.state["sum"][:t.size])
    assert version_dir(down, 3) == vdir
