"""``--on_divergence=rollback`` piece by piece (issue 28); the whole job:
``tests/integration/test_training_health.py::test_a_diverging_ps_job_rolls_back_cuts_the_rate_and_trains_healthy``.

* the core opens a PS rollback with no PS to launch, counts it (journaled: a restarted
  master replays the same count and protocol) and hands every training task the cut
  learning-rate scale; the loss is judged afresh only when the rollback closes;
* a PS applies a push group with the smallest scale of its pushes, on top of the
  schedule (the parameters after the step show it), and refuses a scale outside (0, 1];
* the scale survives the hand-written chunk parser and the task wire;
* the checkpoints above the rollback's source are set aside, idempotently, and the
  source is the newest checkpoint at or below the best window's version;
* the spec refuses rollback without PS and checkpoints.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from elasticdl.checkpoint import paths, restore
from elasticdl.common import chunk_wire, wire
from elasticdl.common.task import Task, TaskType
from elasticdl.master.protocols import Kind, Step
from elasticdl.master.training_health import final_status
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.ps.shard import GradientPush, PSShard, ShardConfig
from tests.unit.master.test_training_health import _core, _train
from tests.unit.ps_helpers import push_together

SOURCE = {"dir": "/ckpt/version-15", "checkpoint": 15}


def test_the_core_opens_a_rollback_cuts_the_rate_and_judges_afresh_at_the_close(tmp_path):
    from elasticdl.master.journal import Journal

    core = _core()
    core.divergence_lr_factor = 0.5
    core.attach_journal(Journal(str(tmp_path / "j"), fsync=False))
    core.begin()
    _train(core, [2.3, 2.3, 1.0, 0.9, 0.8, 0.7, 2.3, 2.3, 2.3, 2.3])
    assert core.health_verdict() is not None and core.lr_scale() == 1.0
    p = core.divergence_rollback(SOURCE, 100.0)
    assert p is not None and p.kind == Kind.ROLLBACK and p.step == Step.REQUESTED
    assert p.data == {"launch": [], "set_aside": True, **SOURCE}
    assert core.divergence_rollback(SOURCE, 101.0) is None   # one at a time
    assert core.lr_scale() == 0.5 and core.divergence_rollbacks() == 1
    assert core.sync_group() == 0     # a sync job's PS: their own mode
    # the verdict stands while the diverged model still trains, until every PS is back
    assert core.health_verdict() is not None
    # a restarted master replays the same protocol and count
    again = _core()
    again.divergence_lr_factor = 0.5
    again.restore(Journal(str(tmp_path / "j"), fsync=False))
    assert again.lr_scale() == 0.5 and [q.data for q in again.open_protocols()] == [p.data]
    core.protocol_close(p.pid)
    assert core.health_verdict() is None and core.health.restarts == 1
    # a job that needed a rollback to end healthy is not a plain success
    assert final_status("succeeded", None, core.divergence_rollbacks()) == \
        "succeeded_with_warnings"


def test_an_async_job_goes_on_synchronously_and_cuts_the_rate_from_its_second_rollback():
    """--divergence_sync: the first rollback's remedy is the switch (every later task
    tells the PS to group the live workers' pushes), the rate untouched; a second
    rollback, already synchronous, cuts the rate."""
    core = _core()
    core.divergence_lr_factor = 0.5
    core.divergence_sync, core.divergence_sync_workers = True, 3   # an async job's
    core.begin()
    assert core.sync_group() == 0 and core.lr_scale() == 1.0   # the PS's own (async) mode
    p = core.divergence_rollback(SOURCE, 100.0)
    assert core.sync_group() == 3 and core.lr_scale() == 1.0
    core.replicas.new_worker()        # once the live workers are known: theirs
    assert core.sync_group() == 1
    core.protocol_close(p.pid)
    core.divergence_rollback(SOURCE, 200.0)
    assert core.sync_group() == 1 and core.lr_scale() == 0.5


def test_a_divergence_rollback_voids_a_claimed_export():
    core = _core()
    _train(core, [1.0] * 40)   # every task of the job (400 records, 10 a task)
    assert core.finished() and core.claim_export(0) and core.exporter() == 0
    core.divergence_rollback(SOURCE, 100.0)
    export = next(p for p in core.open_protocols() if p.kind == Kind.EXPORT)
    assert export.step == Step.OPEN and core.exporter() is None   # claimed again later


def test_a_ps_applies_the_groups_smallest_scale_on_top_of_the_schedule():
    w0 = torch.zeros(3)
    shard = PSShard(ShardConfig(grads_to_wait=2), lambda p: torch.optim.SGD(p, lr=1.0))
    shard.initialize(0, {"w": w0.clone()}, {}, [])
    grad = torch.ones(3)
    pushes = [GradientPush(version=0, worker_id=w, dense={"w": grad}, task_id=w + 1,
                           minibatch=1, num_records=4, lr_scale=s)
              for w, s in ((0, 0.5), (1, 0.25))]
    push_together(shard, pushes)
    # one update of the mean gradient (1.0) at lr 1.0 x min(0.5, 0.25)
    assert torch.allclose(shard.params.dense["w"], w0 - 0.25), shard.params.dense["w"]
    with pytest.raises(ValueError, match="lr_scale must be in"):
        shard.push_gradients(GradientPush(version=shard.version, dense={"w": grad},
                                          lr_scale=1.5))


def test_an_async_ps_told_to_group_applies_one_synchronous_step_a_round():
    """--divergence_sync: pushes carrying ``sync_group=2`` to an async PS wait for each
    other and are applied as one step of their record-weighted mean (a plain async
    push: a step of its own); a push computed on an older version is refused (the
    worker pulls and recomputes it), never applied stale."""
    w0 = torch.zeros(3)
    shard = PSShard(ShardConfig(use_async=True), lambda p: torch.optim.SGD(p, lr=1.0))
    shard.initialize(0, {"w": w0.clone()}, {}, [])
    shard.push_gradients(GradientPush(version=0, dense={"w": torch.ones(3)}, task_id=1,
                                      minibatch=1, num_records=4))
    assert shard.version == 1 and torch.equal(shard.params.dense["w"], w0 - 1)
    pushes = [GradientPush(version=1, worker_id=w, dense={"w": torch.full((3,), g)},
                           task_id=w + 2, minibatch=1, num_records=n, sync_group=2)
              for w, g, n in ((0, 2.0, 1), (1, 5.0, 2))]
    results = push_together(shard, pushes)
    assert [r.accepted for r in results] == [True, True] and shard.version == 2
    # one step: -1 - (2 x 1 + 5 x 2) / 3 = -5 (async: two steps, -1 - 2 - 5 = -8)
    assert torch.allclose(shard.params.dense["w"], w0 - 5), shard.params.dense["w"]
    stale = shard.push_gradients(GradientPush(version=1, dense={"w": torch.ones(3)},
                                              task_id=9, minibatch=1, num_records=1,
                                              sync_group=2))
    assert not stale.accepted and shard.version == 2
    with pytest.raises(ValueError, match="sync_group must be in"):
        shard.push_gradients(GradientPush(version=2, dense={"w": torch.ones(3)},
                                          sync_group=-1))


def test_the_scale_and_the_group_cross_both_wires():
    raw = chunk_wire.gradient_chunk_bytes([b""], version=1, lr_scale=0.125, sync_group=4)
    assert chunk_wire.parse_gradient_chunk(raw).lr_scale == 0.125
    assert pb.GradientChunk.FromString(raw).lr_scale == 0.125
    assert chunk_wire.parse_gradient_chunk(raw).sync_group == 4
    assert pb.GradientChunk.FromString(raw).sync_group == 4
    task = Task(7, TaskType.TRAINING, "s", 0, 8, 0, lr_scale=0.5, sync_group=3)
    assert wire.task_from_proto(wire.task_to_proto(task)).lr_scale == 0.5
    assert wire.task_from_proto(wire.task_to_proto(task)).sync_group == 3
    plain = Task(8, TaskType.TRAINING, "s", 0, 8, 0)
    assert wire.task_to_proto(plain).lr_scale == 0.0          # not on the wire
    assert wire.task_from_proto(wire.task_to_proto(plain)).lr_scale == 1.0


def test_the_diverged_checkpoints_are_set_aside_and_the_source_precedes_the_best(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    for v in (5, 10, 15, 20, 25):
        os.makedirs(paths.version_dir(ckpt, v))
        open(os.path.join(paths.version_dir(ckpt, v), paths.DONE), "w").close()
    os.makedirs(paths.version_dir(ckpt, 30))   # incomplete: not a version, left alone
    spec = SimpleNamespace(checkpoint_dir=ckpt, checkpoint_dir_for_init="")
    source = restore.rollback_source(spec, 0, at_most=17)
    assert source is not None and source["checkpoint"] == 15
    assert paths.set_aside(ckpt, 15) == [20, 25]
    assert paths.set_aside(ckpt, 15) == []                     # idempotent
    assert paths.complete_versions(ckpt) == [5, 10, 15]
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("diverged-")) == \
        ["diverged-version-20", "diverged-version-25"]
    assert restore.rollback_source(spec, 0, at_most=4) is None


def test_a_model_bad_again_right_after_a_rollback_goes_back_further(tmp_path):
    """Async digits jobs: a model restored from checkpoint 10 collapsed again a few
    versions after the restart (it was dying there), and the next rollback chose
    checkpoint 10 again, or one the dying model wrote since; the job failed after 3
    rollbacks, or ended at chance accuracy. A model that went bad within a window of a
    restart goes back further than that restart's source, where there is one."""
    ckpt = str(tmp_path / "ckpt")
    for v in (0, 10, 20):
        os.makedirs(paths.version_dir(ckpt, v))
        open(os.path.join(paths.version_dir(ckpt, v), paths.DONE), "w").close()
    spec = SimpleNamespace(checkpoint_dir=ckpt, checkpoint_dir_for_init="")
    for v in (100, 110):   # written after the restart at 100
        os.makedirs(paths.version_dir(ckpt, v))
        open(os.path.join(paths.version_dir(ckpt, v), paths.DONE), "w").close()
    assert restore.divergence_source(spec, 0, 15, None)["checkpoint"] == 10
    # restored from 10 at version 100: bad again by 105 (no newer checkpoint: 10 again) or
    # by 112 (within the 32-version window: the dying model wrote 110) -> older than 10
    assert restore.divergence_source(spec, 0, 105, (10, 100), 32)["checkpoint"] == 0
    assert restore.divergence_source(spec, 0, 112, (10, 100), 32)["checkpoint"] == 0
    # it trained well for a while after the restart: its own newer checkpoint
    assert restore.divergence_source(spec, 0, 140, (10, 100), 32)["checkpoint"] == 110
    assert restore.divergence_source(spec, 0, 5, (0, 100), 32)["checkpoint"] == 0  # none older


def test_the_spec_refuses_a_rollback_it_cannot_do():
    from elasticdl.common.job_spec import JobSpecError, job_spec_from_flags

    base = {"model_zoo": "z", "model_def": "m.f", "training_data": "d",
            "on_divergence": "rollback"}
    ps = {**base, "distribution_strategy": "ParameterServerStrategy"}
    with pytest.raises(JobSpecError, match="rollback needs ParameterServerStrategy"):
        job_spec_from_flags("train", base)
    with pytest.raises(JobSpecError, match="rollback needs ParameterServerStrategy"):
        job_spec_from_flags("train", ps)
    spec = job_spec_from_flags("train", {**ps, "checkpoint_dir": "/c",
                                         "checkpoint_steps": 10})
    assert spec.on_divergence == "rollback" and spec.divergence_lr_factor == 0.5
    with pytest.raises(JobSpecError, match="divergence_lr_factor"):
        job_spec_from_flags("train", {**ps, "checkpoint_dir": "/c", "checkpoint_steps": 10,
                                      "divergence_lr_factor": 0.0})
