"""Elastic scheduling decisions (master/scaling.py): pure policy over views, the
worker bookkeeping's timeline and state, --num_workers=MIN:MAX parsing, the sync
PS group following the live worker count, and preemption read from pod status."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from elasticdl.common.job_spec import JobSpecError, job_spec_from_flags, parse_worker_range
from elasticdl.master.scaling import (
    MAX_POINTS,
    Kind,
    ScalingPolicy,
    ScalingView,
    WorkerCounts,
)
from elasticdl.ps.shard import GradientPush, PSShard, ShardConfig
from tests.unit.ps_helpers import push_together, sgd


def view(**kw) -> ScalingView:
    base = dict(min_workers=2, max_workers=4, live=(0, 1, 2, 3), running=frozenset({0, 1}),
                pending={2: "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.",
                         3: "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."},
                retiring=frozenset(), idle=frozenset(), slots_closed=0, finishing=False,
                under_min_s=0.0, min_timeout_s=60.0, fail_on_timeout=False, warned=False)
    base.update(kw)
    return ScalingView(**base)  # type: ignore[arg-type]


def kinds(decisions):
    return [(d.kind, d.count, d.workers) for d in decisions]


def test_at_max_nothing_to_do_even_with_pending_workers():
    assert ScalingPolicy().decide(view()) == []


def test_scale_up_launches_the_difference():
    got = ScalingPolicy().decide(view(max_workers=6))
    assert kinds(got) == [(Kind.LAUNCH, 2, ())]


def test_scale_down_retires_pending_before_running_newest_first():
    got = ScalingPolicy().decide(view(max_workers=1))
    assert kinds(got) == [(Kind.RETIRE, 0, (1, 2, 3))]
    got = ScalingPolicy().decide(view(max_workers=3))
    assert kinds(got) == [(Kind.RETIRE, 0, (3,))]


def test_retired_workers_are_stopped_once_idle_or_not_running():
    got = ScalingPolicy().decide(view(max_workers=2, retiring=frozenset({1, 3}),
                                      idle=frozenset()))
    assert kinds(got) == [(Kind.STOP, 0, (3,))]   # 1 runs and holds a task: not yet
    got = ScalingPolicy().decide(view(max_workers=2, retiring=frozenset({1, 3}),
                                      idle=frozenset({1})))
    assert kinds(got) == [(Kind.STOP, 0, (1, 3))]


def test_closed_slots_are_not_refilled():
    # worker 3 finished (or was dropped after its failures): 3 live of MAX 4 is right
    got = ScalingPolicy().decide(view(live=(0, 1, 2), slots_closed=1))
    assert got == []


def test_training_over_cancels_pending_workers_only():
    got = ScalingPolicy().decide(view(finishing=True))
    assert kinds(got) == [(Kind.CANCEL, 0, (2, 3))]


def test_an_open_final_export_keeps_pending_workers():
    # the one launched for the export starts pending: cancelling it would loop forever
    assert ScalingPolicy().decide(view(finishing=True, exporting=True)) == []


def test_under_min_is_bounded_warn_once_or_fail_with_the_scheduler_reason():
    v = view(running=frozenset({0}), under_min_s=61.0)
    (d,) = ScalingPolicy().decide(v)
    assert d.kind == Kind.UNDER_MIN and "Insufficient nvidia.com/gpu" in d.reason
    assert "1 of MIN 2" in d.reason
    assert ScalingPolicy().decide(view(running=frozenset({0}), under_min_s=61.0,
                                       warned=True)) == []
    (d,) = ScalingPolicy().decide(view(running=frozenset({0}), under_min_s=61.0,
                                       fail_on_timeout=True))
    assert d.kind == Kind.FAIL
    assert ScalingPolicy().decide(view(running=frozenset({0}), under_min_s=59.0)) == []


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_counts_timeline_time_under_min_and_state_roundtrip():
    clock = Clock()
    c = WorkerCounts(2, 4, clock=clock)
    for w in range(4):
        c.launched(w)
    assert c.tick() == 0.0 or c.under_min_since is not None
    c.observe(0, True)
    clock.t += 10
    c.observe(1, True)
    assert c.tick() == 0.0        # 2 running: at MIN
    c.observe(2, False, "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    clock.t += 5
    assert c.gone(1, preempted=True) is False
    assert c.tick() == 0.0        # the stretch under MIN starts now
    clock.t += 7
    assert c.tick() == 7.0
    c.observe(3, True)
    c.tick()
    r = c.report()
    assert r["running"] == 2 and r["pending"] == 1 and r["preempted"] == 1
    assert r["time_under_min_s"] == pytest.approx(7.0 + 0.0, abs=1e-6) or \
        r["time_under_min_s"] >= 7.0
    assert r["pending_reasons"] == ["0/1 nodes are available: 1 Insufficient nvidia.com/gpu."]
    assert [p[1:] for p in r["timeline"]][-1] == [2, 1, 1]
    entry = c.resize(1, 3, "elasticdl scale")
    assert entry["from"] == "2:4" and entry["to"] == "1:3"
    d = WorkerCounts(9, 9)
    d.load_state_dict(c.state_dict())
    assert d.report() == {**c.report(), "time_under_min_s": d.report()["time_under_min_s"]}
    with pytest.raises(ValueError):
        c.resize(3, 2, "bad")


def test_timeline_stays_bounded():
    clock = Clock()
    c = WorkerCounts(1, 2, clock=clock)
    for i in range(10 * MAX_POINTS):
        clock.t += 1
        c.observe(0, i % 2 == 0)
    assert len(c.report()["timeline"]) <= MAX_POINTS
    assert c.report()["timeline"][-1][0] == clock.t


def test_retired_worker_is_not_a_closed_slot():
    c = WorkerCounts(1, 2)
    c.launched(0)
    c.launched(1)
    c.retire((1,))
    assert c.gone(1, done=True) is True
    assert c.slots_closed == 0
    assert c.gone(0, done=True) is False and c.slots_closed == 1


@pytest.mark.parametrize("text,expected", [("3", (3, 3)), ("2:4", (2, 4)), ("1:1", (1, 1))])
def test_worker_range_parses(text, expected):
    assert parse_worker_range(text) == expected


@pytest.mark.parametrize("text", ["0:2", "3:2", "a:b", "1:2:3", "", ":"])
def test_worker_range_rejects_naming_the_flag(text):
    with pytest.raises(JobSpecError, match="--num_workers"):
        parse_worker_range(text)


def test_num_workers_min_max_flag_sets_both():
    spec = job_spec_from_flags("train", {"model_zoo": "z", "model_def": "m.f",
                                         "training_data": "d", "num_workers": "2:4",
                                         "distribution_strategy": "ParameterServerStrategy"})
    assert (spec.min_workers, spec.num_workers, spec.workers_min) == (2, 4, 2)
    fixed = spec.replace(min_workers=0, num_workers=3)
    assert fixed.workers_min == 3
    with pytest.raises(JobSpecError, match="--num_workers"):
        job_spec_from_flags("train", {"model_zoo": "z", "model_def": "m.f",
                                      "training_data": "d", "num_workers": "5:4",
                                      "distribution_strategy": "ParameterServerStrategy"})


def test_sync_ps_group_follows_the_live_worker_count():
    """grads_to_wait=4 with 2 workers running: a group of 2 is applied at once (not
    after the 30 s wait), as the mean of the two pushes."""
    w0 = torch.zeros(3)
    shard = PSShard(ShardConfig(grads_to_wait=4, sync_wait_s=30), sgd(1.0))
    shard.initialize(0, {"w": w0}, {}, [])
    shard.set_live_workers(2)
    pushes = [GradientPush(version=0, worker_id=i, dense={"w": torch.full((3,), float(i + 1))},
                           task_id=10 + i, minibatch=1, num_records=1) for i in range(2)]
    started = time.monotonic()
    push_together(shard, pushes, timeout_s=20)
    assert time.monotonic() - started < 10
    assert shard.version == 1
    assert torch.allclose(shard.params.dense["w"].detach(), torch.full((3,), -1.5))


def test_sync_ps_pending_group_completes_when_workers_leave():
    shard = PSShard(ShardConfig(grads_to_wait=3, sync_wait_s=30), sgd(1.0))
    shard.initialize(0, {"w": torch.zeros(2)}, {}, [])
    shard.set_live_workers(3)
    push = GradientPush(version=0, worker_id=0, dense={"w": torch.ones(2)}, task_id=1,
                        minibatch=1, num_records=1)
    t = threading.Thread(target=shard.push_gradients, args=(push,))
    t.start()
    time.sleep(0.3)
    assert shard.version == 0
    shard.set_live_workers(1)   # the others were preempted: the group of one is complete
    t.join(10)
    assert not t.is_alive() and shard.version == 1


def _core_with_counts():
    from tests.unit.master.test_journal import make_core

    core = make_core()
    core.attachments["scaling"] = WorkerCounts(2, 4)
    return core


@pytest.mark.parametrize("snapshot_between", [False, True])
def test_resize_is_journaled_and_survives_a_master_restart(tmp_path, snapshot_between):
    """A resize acknowledged to `elasticdl scale` is in the journal: a master restored
    from it (snapshot + records after it) has the new bounds and the resize entries."""
    import shutil

    from elasticdl.master.journal import Journal

    a = _core_with_counts()
    a.attach_journal(Journal(str(tmp_path / "j")))
    a.begin()
    a.resize_workers(1, 3, "elasticdl scale --num_workers=1:3")
    if snapshot_between:
        a.snapshot()
    a.resize_workers(5, 6, "elasticdl scale --num_workers=5:6")
    a.durable()
    shutil.copytree(tmp_path / "j", tmp_path / "copy")   # the master is killed here
    b = _core_with_counts()
    b.restore(Journal(str(tmp_path / "copy")))
    r = b.attachments["scaling"].report()
    assert (r["min"], r["max"]) == (5, 6)
    assert [(e["from"], e["to"]) for e in r["resizes"]] == [("2:4", "1:3"), ("1:3", "5:6")]
    with pytest.raises(ValueError):
        b.resize_workers(3, 1, "bad")


def test_status_lines_show_running_pending_reasons_and_resizes():
    from elasticdl_client import job_figures

    c = WorkerCounts(2, 4)
    for w in range(4):
        c.launched(w)
    c.observe(0, True)
    c.observe(1, True)
    c.observe(2, False, "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    c.resize(2, 3, "elasticdl scale --num_workers=2:3")
    lines = "\n".join(job_figures.from_report({"workers": c.report()}))
    assert "workers: 2 running, 2 pending (MIN:MAX 2:3), 0 preempted" in lines
    assert "pending because: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu." in lines
    assert "resize: 2:4 -> 2:3 (elasticdl scale --num_workers=2:3)" in lines
