"""PS recovery without mixing versions (issue 10 item 10) and sync staleness that
never fails a healthy worker (issue 11), with in-process PS over gRPC."""

from __future__ import annotations

import threading
from typing import Any

import torch

from elasticdl.api.model_spec import load_model_spec
from elasticdl.checkpoint import api as ckpt_api
from elasticdl.checkpoint import ps_shards as ps_ckpt
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.task import Task
from elasticdl.master import ps_rollback
from elasticdl.master.task_manager import TaskManager
from elasticdl.ps import shard_checkpoint as shard_ckpt
from elasticdl.ps.main import checkpoint_every_n
from elasticdl.ps.server import start_server
from elasticdl.ps.servicer import PServicer
from elasticdl.ps.shard import GradientPush, PSShard, ShardConfig
from elasticdl.worker.ps_client import PSClient
from elasticdl.worker.ps_trainer import PSTrainer
from elasticdl.worker.trainer import LocalTrainer
from tests.conftest import FIXTURE_ZOO
from tests.unit.ps.test_ps_semantics import _assert_state_equal, _records
from tests.unit.ps_helpers import local_ps, sgd

MODEL_DEF = "toy.ctr.custom_model"
MB = 2  # records per minibatch


def _job(**kw) -> JobSpec:
    return JobSpec(model_zoo=FIXTURE_ZOO, model_def=MODEL_DEF, training_data="unused",
                   distribution_strategy="ParameterServerStrategy", seed=3, **kw)


def _trainer(addrs: list[str], job: JobSpec, worker_id: int = 0, **kw) -> PSTrainer:
    client = PSClient(addrs, rpc_timeout_s=20, reconnect_timeout_s=20)
    return PSTrainer(load_model_spec(FIXTURE_ZOO, MODEL_DEF), addrs, job, worker_id,
                     torch.device("cpu"), client=client, init_timeout_s=20, **kw)


def _shard(i: int, ckpt_dir: str) -> PSShard:
    cfg = ShardConfig(ps_id=i, num_ps=2, checkpoint_dir=ckpt_dir, checkpoint_steps=2)
    return PSShard(cfg, sgd(0.1), on_version=checkpoint_every_n)


def _run(trainer: PSTrainer, task: Task, records: list[Any], minibatches: list[int],
         order: list[tuple[int, int]]) -> None:
    spec = trainer.spec
    for k in minibatches:
        trainer.set_position(task.task_id, k, MB)
        chunk = records[task.start + MB * (k - 1):task.start + MB * k]
        trainer.train_minibatch(*spec.feed(chunk, "training"))
        order.append((task.start, k))


def test_item10_ps_relaunch_rolls_every_ps_back_to_one_version_and_requeues_after_it(
        tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    spec = load_model_spec(FIXTURE_ZOO, MODEL_DEF)
    records = _records(12)
    tm = TaskManager([("mem", 0, 12)], records_per_task=2 * MB)  # 3 tasks x 2 minibatches
    shards = [_shard(i, ckpt_dir) for i in range(2)]
    servers, ports = zip(*(start_server(PServicer(s), 0, "127.0.0.1") for s in shards))
    servers = list(servers)
    addrs = [f"127.0.0.1:{p}" for p in ports]
    order: list[tuple[int, int]] = []  # (task start, minibatch) in application order
    trainer = _trainer(addrs, _job(num_ps_pods=2, minibatch_size=MB))
    try:
        for _ in range(2):  # two tasks, versions 1-4; checkpoints 2 and 4
            task = tm.get(0)
            _run(trainer, task, records, [1, 2], order)
            tm.report(task.task_id, 0, True, counters=trainer.finish_task(task))
        third = tm.get(0)
        _run(trainer, third, records, [1], order)  # version 5: not in any checkpoint
        assert [s.version for s in shards] == [5, 5]
        # PS 1 dies and is relaunched from checkpoint 4, waiting for the rollback
        servers[1].stop(0).wait(5)
        relaunched = _shard(1, ckpt_dir)
        shard_ckpt.restore_shard(relaunched, ckpt_api.latest(ckpt_dir))
        relaunched.awaiting_rollback = True
        servers[1], _ = start_server(PServicer(relaunched), ports[1], "127.0.0.1")
        shards[1] = relaunched
        assert ps_rollback.newest_version(ckpt_dir) == 4
        new_version, applied = ps_rollback.rollback_all(addrs, 4, timeout_s=30)
        assert new_version > 5  # version numbers never repeat
        assert [s.version for s in shards] == [new_version] * 2
        at_4 = ps_ckpt.export_state_dict(ckpt_api.latest(ckpt_dir))
        for s in shards:  # every PS holds version 4's values: no mixing
            for name, value in s.params.dense.items():
                assert torch.equal(value.detach(), at_4[name]), name
        assert tm.rollback(applied, new_version) == []  # tasks 1, 2 are fully in version 4
        order.pop()  # the third task's first minibatch was lost with the rollback
        # the holder of the third task goes on: its report finds minibatch 1 missing
        _run(trainer, third, records, [2], order)
        tm.report(third.task_id, 0, True, counters=trainer.finish_task(third))
        again = tm.get(0)
        assert again.task_id == third.task_id  # re-queued, not counted
        skip = trainer.start_task(again)
        assert skip == frozenset({2})
        _run(trainer, again, records, [1], order)
        tm.report(again.task_id, 0, True, counters=trainer.finish_task(again))
        assert tm.finished()
        ps_state = trainer.state_dict_from_ps()
    finally:
        trainer.close()
        for server in servers:
            server.stop(0).wait(5)
    assert [e["records_applied"] for e in tm.epochs_report()] == [12]
    ref = LocalTrainer(spec, torch.device("cpu"), seed=3)
    for start, k in order:
        chunk = records[start + MB * (k - 1):start + MB * k]
        ref.train_minibatch(*spec.feed(chunk, "training"))
    _assert_state_equal(ps_state, {n: t.detach() for n, t in ref.model.state_dict().items()})


def test_issue11_stale_rejections_under_load_never_fail_a_healthy_worker():
    """A peer keeps moving the version on: the worker's pushes are rejected as
    stale more often than the old fixed 32 attempts, and it still succeeds."""
    spec = load_model_spec(FIXTURE_ZOO, MODEL_DEF)
    with local_ps(1, sgd(0.01)) as cluster:
        shard = cluster.shards[0]
        rejected = [0]
        original = shard.push_gradients

        def counting(push: GradientPush):
            result = original(push)
            if push.worker_id == 1 and not result.accepted:
                rejected[0] += 1
            return result

        shard.push_gradients = counting  # type: ignore[method-assign]
        trainer = _trainer(cluster.addrs, _job(minibatch_size=4), worker_id=1)
        stop = threading.Event()

        def busy_peer() -> None:  # pushes on the newest version as fast as it can
            zero = {n: torch.zeros_like(p) for n, p in shard.params.dense.items()}
            while not stop.is_set() and rejected[0] < 33:
                original(GradientPush(version=shard.version, worker_id=2, dense=zero))
                stop.wait(0.002)  # let the worker's threads run

        peer = threading.Thread(target=busy_peer)
        peer.start()
        try:
            # the peer pushes between this worker's pull and push: stale every time
            hook = _slow_forward(trainer)
            loss = trainer.train_minibatch(*spec.feed(_records(4), "training"))
            hook.remove()
            assert torch.isfinite(loss)
            assert rejected[0] >= 33, rejected[0]  # the old code gave up after 32
        finally:
            stop.set()
            peer.join(30)
            trainer.close()


def _slow_forward(trainer: PSTrainer) -> Any:
    """Make each forward take a little while, so the busy peer always gets a push in."""
    def hook(module, inputs):
        threading.Event().wait(0.01)

    return trainer.model.register_forward_pre_hook(hook)


def test_task_reported_with_applied_figures_read_before_a_rollback_is_requeued():
    tm = TaskManager([("a", 0, 4)], records_per_task=4)
    t = tm.get(1)
    tm.rollback({}, new_version=50)
    tm.report(t.task_id, 1, True, counters={"records_applied": 4, "applied_at_version": 7})
    assert tm.epochs_report()[0]["records_completed"] == 0
    assert tm.get(2).task_id == t.task_id
