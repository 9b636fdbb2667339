"""Learning-rate schedules on the parameter server (issue 15, item 1): the
model's scheduler runs on every shard, per epoch (the pushes' task epoch) or
per applied update, reaches the embedding rows, is never undone (also not by
async staleness modulation), and survives a PS checkpoint.

Each test compares the parameters the PS produced with what torch's own
optimizer + scheduler give.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from elasticdl.api.model_spec import LRSchedule
from elasticdl.checkpoint import ps_shards as ps_ckpt
from elasticdl.common.tables import TableSpec
from elasticdl.ps import shard_checkpoint as shard_ckpt
from elasticdl.ps.shard import GradientPush, PSShard, ShardConfig

W0 = torch.arange(6, dtype=torch.float32).reshape(2, 3)
TABLE = TableSpec(name="emb.weight", num_embeddings=10, dim=3, initializer="normal:0.1",
                  seed=7)
IDS = np.array([1, 4, 7], dtype=np.int64)


def _steplr(opt):
    return LRSchedule(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7), "epoch")


def _exp_per_step(opt):
    return LRSchedule(torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9), "step")


def _shard(schedule, dense=True, **config) -> PSShard:
    shard = PSShard(ShardConfig(**config), lambda p: torch.optim.SGD(p, lr=1.0),
                    lr_scheduler=schedule)
    shard.initialize(0, {"w": W0.clone()} if dense else {}, {}, [TABLE])
    return shard


def _grad(k: int) -> torch.Tensor:
    return torch.full((2, 3), 0.1 * (k + 1))


def _rows_grad(k: int) -> torch.Tensor:
    return torch.full((3, 3), 0.01 * (k + 1))


def _push(shard: PSShard, k: int, epoch: int, version: int = -1, dense: bool = True):
    return shard.push_gradients(GradientPush(
        version=shard.version if version < 0 else version, epoch=epoch,
        dense={"w": _grad(k)} if dense else {},
        sparse=[("emb.weight", IDS, _rows_grad(k))], task_id=1, minibatch=k + 1,
        num_records=4))


def _reference(epochs: list[int], make_sched, interval: str) -> tuple[list[float], torch.Tensor,
                                                                       torch.Tensor]:
    """torch's SGD + scheduler over w and the three rows (dense, all rows in every step)."""
    w = torch.nn.Parameter(W0.clone())
    rows = torch.nn.Parameter(TABLE.initial_rows(IDS).clone())
    opt = torch.optim.SGD([w, rows], lr=1.0)
    sched = make_sched(opt).scheduler
    lrs, current = [], 0
    for k, epoch in enumerate(epochs):
        if interval == "epoch":
            for _ in range(epoch - current):
                sched.step()
            current = max(current, epoch)
        lrs.append(opt.param_groups[0]["lr"])
        w.grad, rows.grad = _grad(k), _rows_grad(k)
        opt.step()
        if interval == "step":
            sched.step()
    return lrs, w.detach(), rows.detach()


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "rows-only-placeholder"])
def test_steplr_per_epoch_gives_torchs_lrs_on_dense_and_rows(dense):
    epochs = [0, 0, 1, 1, 1, 2, 4, 4]  # epoch 3 had no step on this PS: two crossed at once
    shard = _shard(_steplr, dense=dense)
    applied = [_push(shard, k, e, dense=dense).learning_rate for k, e in enumerate(epochs)]
    lrs, w, rows = _reference(epochs, _steplr, "epoch")
    assert applied == lrs  # exactly torch's values (1, 1, .7, .7, .7, .49, .2401, ...)
    assert lrs[-1] == pytest.approx(0.7 ** 4)
    if dense:
        assert torch.allclose(shard.params.dense["w"], w, atol=1e-6, rtol=0)
    got_rows = shard.pull_embedding("emb.weight", IDS, create=False)
    assert torch.allclose(got_rows, rows, atol=1e-6, rtol=0)  # rows follow the schedule


def test_epochs_never_go_backwards():
    shard = _shard(_steplr)
    assert _push(shard, 0, 2).learning_rate == pytest.approx(0.49)
    assert _push(shard, 1, 1).learning_rate == pytest.approx(0.49)  # an old epoch: no undo
    assert shard.schedule.epoch == 2


def test_step_interval_scheduler_gives_torchs_lrs():
    epochs = [0] * 6 + [1] * 3  # the epoch does not matter to a "step" scheduler
    shard = _shard(_exp_per_step)
    applied = [_push(shard, k, e).learning_rate for k, e in enumerate(epochs)]
    lrs, w, rows = _reference(epochs, _exp_per_step, "step")
    assert applied == lrs
    assert torch.allclose(shard.params.dense["w"], w, atol=1e-6, rtol=0)
    assert torch.allclose(shard.pull_embedding("emb.weight", IDS, False), rows, atol=1e-6,
                          rtol=0)
    assert shard.optimizer.param_groups[0]["lr"] == pytest.approx(0.9 ** len(epochs))


def test_a_ps_relaunched_without_a_checkpoint_catches_up_with_the_step_schedule():
    # the survivor applied 7 updates; the relaunched PS takes a worker's model at
    # version 7 and must apply the next update with the survivor's learning rate
    survivor = _shard(_exp_per_step)
    for k in range(7):
        _push(survivor, k, 0)
    relaunched = PSShard(ShardConfig(), lambda p: torch.optim.SGD(p, lr=1.0),
                         lr_scheduler=_exp_per_step)
    relaunched.initialize(survivor.version, {"w": survivor.params.dense["w"].clone()}, {},
                          [TABLE])
    assert relaunched.version == 7
    assert _push(relaunched, 7, 0).learning_rate == _push(survivor, 7, 0).learning_rate \
        == pytest.approx(0.9 ** 7)
    assert torch.equal(relaunched.params.dense["w"], survivor.params.dense["w"])
    # an epoch schedule is left to the next push's epoch
    epochly = PSShard(ShardConfig(), lambda p: torch.optim.SGD(p, lr=1.0), lr_scheduler=_steplr)
    epochly.initialize(7, {"w": W0.clone()}, {}, [TABLE])
    assert epochly.optimizer.param_groups[0]["lr"] == 1.0
    assert _push(epochly, 0, 2).learning_rate == pytest.approx(0.7 ** 2)


def test_async_staleness_scales_one_apply_and_keeps_the_schedule():
    shard = _shard(_steplr, use_async=True, lr_staleness_modulation=True)
    for k in range(3):
        _push(shard, k, 1)                      # epoch 1: lr 0.7
    before_w = shard.params.dense["w"].clone()
    before_rows = shard.pull_embedding("emb.weight", IDS, False).clone()
    stale = _push(shard, 3, 1, version=shard.version - 3)   # staleness 3
    assert stale.learning_rate == pytest.approx(0.7 / 3)
    assert torch.allclose(shard.params.dense["w"], before_w - 0.7 / 3 * _grad(3), atol=1e-6)
    assert torch.allclose(shard.pull_embedding("emb.weight", IDS, False),
                          before_rows - 0.7 / 3 * _rows_grad(3), atol=1e-6)
    # the scheduled lr is back, not the pre-scheduler one (1.0): nothing was undone
    assert shard.optimizer.param_groups[0]["lr"] == pytest.approx(0.7)
    assert _push(shard, 4, 1).learning_rate == pytest.approx(0.7)
    assert _push(shard, 5, 2).learning_rate == pytest.approx(0.49)


@pytest.mark.parametrize("interval", ["epoch", "step"])
def test_schedule_round_trips_through_a_ps_checkpoint(tmp_path, interval):
    make = _steplr if interval == "epoch" else _exp_per_step
    epochs = [0, 1, 1, 2, 3, 3]
    shard = _shard(make)
    for k, e in enumerate(epochs[:4]):
        _push(shard, k, e)
    shard_ckpt.save_shard(shard, str(tmp_path), None, 0)
    restored = PSShard(ShardConfig(), lambda p: torch.optim.SGD(p, lr=1.0), lr_scheduler=make)
    shard_ckpt.restore_shard(restored, ps_ckpt.version_dir_of(str(tmp_path), shard.version))
    assert restored.schedule.epoch == shard.schedule.epoch == 2
    assert restored.schedule.schedule.scheduler.state_dict() == \
        shard.schedule.schedule.scheduler.state_dict()
    rest = [_push(restored, k, e).learning_rate for k, e in enumerate(epochs) if k >= 4]
    lrs, w, _ = _reference(epochs, make, interval)
    assert rest == lrs[4:]
    assert torch.allclose(restored.params.dense["w"], w, atol=1e-6, rtol=0)


def test_sync_group_applies_with_one_lr_and_answers_it_to_every_member():
    shard = _shard(_steplr, grads_to_wait=2, sync_wait_s=20)
    out = []
    t = threading.Thread(target=lambda: out.append(shard.push_gradients(GradientPush(
        version=0, epoch=1, dense={"w": _grad(0)}, task_id=1, minibatch=1))))
    t.start()
    second = shard.push_gradients(GradientPush(version=0, epoch=1, dense={"w": _grad(1)},
                                               task_id=2, minibatch=1))
    t.join(20)
    assert second.learning_rate == out[0].learning_rate == pytest.approx(0.7)
    assert shard.version == 1


def test_reduce_on_plateau_is_refused_clearly():
    shard = PSShard(ShardConfig(), lambda p: torch.optim.SGD(p, lr=1.0), lr_scheduler=lambda o:
                    LRSchedule(torch.optim.lr_scheduler.ReduceLROnPlateau(o), "epoch"))
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        shard.initialize(0, {"w": W0.clone()}, {}, [])
    assert not shard.initialized


def test_rollback_restores_the_checkpointed_schedule(tmp_path):
    shard = _shard(_steplr, checkpoint_dir=str(tmp_path))
    for k, e in enumerate([0, 1, 2]):
        _push(shard, k, e)
    shard_ckpt.save_shard(shard, str(tmp_path), None, 0)
    saved = shard.version
    assert _push(shard, 3, 3).learning_rate == pytest.approx(0.343)  # after the checkpoint
    shard.rollback(lambda s: shard_ckpt.restore_shard(
        s, ps_ckpt.version_dir_of(str(tmp_path), saved)), saved + 100)
    assert shard.schedule.epoch == 2 and shard.schedule.lr() == pytest.approx(0.49)
    assert _push(shard, 4, 3).learning_rate == pytest.approx(0.343)  # epoch 3 again


# ------------------------------------------------- grad_scale / discard pushes
def test_grad_scale_and_discard_in_a_sync_group():
    shard = _shard(None, grads_to_wait=2, sync_wait_s=20)
    out = []
    t = threading.Thread(target=lambda: out.append(shard.push_gradients(GradientPush(
        version=0, dense={"w": torch.full((2, 3), float("inf"))}, discard=True,
        task_id=1, minibatch=1, num_records=4))))
    t.start()
    shard.push_gradients(GradientPush(version=0, dense={"w": torch.ones(2, 3)},
                                      grad_scale=0.25, task_id=2, minibatch=1,
                                      num_records=4))
    t.join(20)
    assert out[0].accepted and shard.version == 1
    # the discarded push neither adds nor dilutes: w -= lr * 0.25 * 1
    assert torch.allclose(shard.params.dense["w"], W0 - 0.25)
    assert {(e[0], e[1]) for e in shard.applied()[1]} == {(1, 1), (2, 1)}  # both counted


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_grad_scale_is_refused(bad):
    shard = _shard(None)
    with pytest.raises(ValueError, match="grad_scale"):
        shard.push_gradients(GradientPush(version=0, dense={"w": torch.ones(2, 3)},
                                          grad_scale=bad))
    assert torch.equal(shard.params.dense["w"], W0)


def test_new_push_fields_survive_the_hand_written_chunk_parser():
    from elasticdl.common import chunk_wire
    from elasticdl.proto import elasticdl_pb2 as pb

    msg = pb.GradientChunk(version=5, epoch=3, grad_scale=0.375, discard=True, task_id=2)
    view = chunk_wire.parse_gradient_chunk(msg.SerializeToString())
    assert (view.version, view.epoch, view.grad_scale, view.discard, view.task_id) == \
        (5, 3, 0.375, True, 2)
    raw = chunk_wire.gradient_chunk_bytes([b""], version=1, epoch=7)
    assert pb.GradientChunk.FromString(raw).epoch == 7
