"""Issue 21, suspicion 1: a sync PS copied a stale push's buffers (BatchNorm
statistics) into the model before rejecting the push as too old."""

from __future__ import annotations

import torch

from elasticdl.ps.shard import GradientPush, PSShard, ShardConfig
from tests.unit.ps_helpers import sgd


def test_a_rejected_stale_push_leaves_the_buffers_alone():
    shard = PSShard(ShardConfig(grads_to_wait=1, sync_version_tolerance=0), sgd(0.1))
    assert shard.initialize(0, {"w": torch.zeros(2)}, {"bn.running_mean": torch.zeros(2)}, [])
    for v in range(3):   # three accepted pushes: version 3
        assert shard.push_gradients(GradientPush(
            version=v, dense={"w": torch.ones(2)},
            buffers={"bn.running_mean": torch.full((2,), float(v + 1))})).accepted
    before = shard.params.buffers["bn.running_mean"].clone()
    stale = shard.push_gradients(GradientPush(
        version=0, dense={"w": torch.ones(2)},
        buffers={"bn.running_mean": torch.full((2,), -99.0)}))
    assert not stale.accepted
    assert torch.equal(shard.params.buffers["bn.running_mean"], before)
