"""A PS checkpoint records its data position (trained-ps-<i>-of-<n>.json, from the
applied-identity ledger) and is written on the job's one Schedule rule."""

from __future__ import annotations

import torch

from elasticdl.checkpoint import data_position as dp
from elasticdl.checkpoint import ps_shards as ps_ckpt
from elasticdl.checkpoint.paths import complete_versions, version_dir
from elasticdl.ps import shard_checkpoint as shard_ckpt
from elasticdl.ps.main import checkpoint_every_n
from elasticdl.ps.push import GradientPush
from elasticdl.ps.shard import PSShard, ShardConfig
from tests.unit.ps_helpers import sgd

MB = 4


def _shard(ckpt: str) -> PSShard:
    cfg = ShardConfig(ps_id=0, num_ps=1, checkpoint_dir=ckpt, checkpoint_steps=3,
                      minibatch_size=MB)
    return PSShard(cfg, sgd(0.1), on_version=checkpoint_every_n)


def _push(shard: PSShard, task: int, minibatch: int, records: int = MB) -> None:
    shard.push_gradients(GradientPush(version=shard.version, dense={"w": torch.ones(2)},
                                      task_id=task, minibatch=minibatch,
                                      num_records=records))


def test_ps_checkpoints_record_the_applied_minibatches_as_record_offsets(tmp_path):
    ckpt = str(tmp_path)
    shard = _shard(ckpt)
    shard.initialize(0, {"w": torch.zeros(2)}, {}, [])
    for k in range(1, 8):
        _push(shard, 7, k, MB if k < 7 else 1)
    _push(shard, 7, 3)                       # a duplicate: not applied, no new version
    assert shard.version == 7
    shard_ckpt.flush(shard)                  # written in the background
    assert complete_versions(ckpt) == [3, 6]
    assert dp.read_trained(version_dir(ckpt, 3)) == {7: {0: MB, 4: MB, 8: MB}}
    assert dp.read_trained(version_dir(ckpt, 6)) == {7: {o: MB for o in range(0, 24, MB)}}
    # the parameters of version 6 hold exactly those six minibatches
    assert torch.allclose(ps_ckpt.export_state_dict(version_dir(ckpt, 6))["w"],
                          torch.full((2,), -0.6))


def test_restored_ps_goes_on_from_the_restored_version(tmp_path):
    ckpt = str(tmp_path)
    shard = _shard(ckpt)
    shard.initialize(0, {"w": torch.zeros(2)}, {}, [])
    for k in range(1, 5):
        _push(shard, 1, k)
    shard_ckpt.flush(shard)                  # written in the background
    again = _shard(str(tmp_path / "next"))
    shard_ckpt.restore_shard(again, version_dir(ckpt, 3))
    assert again.version == again.last_checkpoint_version == 3
    for k in range(4, 7):                       # versions 4..6: the next multiple is 6
        _push(again, 1, k)
    shard_ckpt.flush(again)
    assert complete_versions(str(tmp_path / "next")) == [6]
    assert dp.read_trained(version_dir(str(tmp_path / "next"), 6)) == {
        1: {o: MB for o in range(0, 24, MB)}}
