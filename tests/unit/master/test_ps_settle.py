"""The master's settle sender against real PS over gRPC: ledgers stay O(live), a
checkpoint taken after compaction settles its tasks, and a rollback to it is
exact — every record applied exactly once, counted on the parameters
(the counting optimizer of tests/fixtures/zoo/toy/count_records.py)."""

from __future__ import annotations

import grpc
import torch

from elasticdl.common.intervals import IntervalSet
from elasticdl.common.tables import dense_owner
from elasticdl.common.task import Task, TaskType
from elasticdl.master import ps_rollback
from elasticdl.master.job import JobCore
from elasticdl.master.ps_settle import Settler
from elasticdl.master.task_manager import TaskManager
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc
from elasticdl.ps import shard_checkpoint as shard_ckpt
from elasticdl.ps.push import GradientPush
from elasticdl.worker.ps_client import PSClient
from tests.fixtures.zoo.toy.count_records import CountUpdates
from tests.unit.ps_helpers import LocalPS, local_ps

N = 32      # records: ids 0..N-1
MB = 2      # records per minibatch
PER_TASK = 4


def _init(cluster: LocalPS) -> None:
    for s in cluster.shards:
        s.initialize(0, {n: torch.zeros(N) for n in ("even", "odd")
                         if dense_owner(n, 2) == s.config.ps_id}, {}, [])


def _push(cluster: LocalPS, task: Task, mb: int) -> None:
    """Minibatch ``mb`` of ``task`` to every PS: gradient 1 at its record ids."""
    for s in cluster.shards:
        name = next(iter(s.params.dense))
        g = torch.zeros(N)
        g[task.start + (mb - 1) * MB:task.start + mb * MB] = 1
        r = s.push_gradients(GradientPush(version=s.version, dense={name: g},
                                          task_id=task.task_id, minibatch=mb, num_records=MB))
        assert r.accepted


def _train(cluster: LocalPS, client: PSClient, core: JobCore, task: Task, worker: int,
           mbs=None) -> None:
    """A worker: skip what every PS applied, push the rest, report (as PSTrainer)."""
    done, _, closed = client.task_applied(task.task_id)
    assert not closed
    for mb in mbs or range(1, PER_TASK // MB + 1):
        if mb not in done:
            _push(cluster, task, mb)
    if mbs is None:
        done, version, closed = client.task_applied(task.task_id)
        applied = task.num_records if closed else sum(done.values())
        core.report_task(task.task_id, worker, True,
                         counters={"records_applied": applied, "applied_at_version": version})


def _counts(cluster: LocalPS) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for s in cluster.shards for n, t in s.params.dense.items()}


def test_rollback_to_a_checkpoint_taken_after_compaction_applies_every_record_once(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    tm = TaskManager([("ids", 0, N)], records_per_task=PER_TASK, num_epochs=1)
    core = JobCore.for_tasks(tm, minibatch_size=MB)
    with local_ps(2, optimizer=lambda p: CountUpdates(p), checkpoint_dir=ckpt,
                  minibatch_size=MB) as cluster:
        _init(cluster)
        client = PSClient(cluster.addrs, rpc_timeout_s=20, reconnect_timeout_s=20)
        settler = Settler(core, cluster.addrs, ckpt, rpc_timeout_s=10)
        try:
            first = [core.get(0) for _ in range(3)]
            for task in first:
                _train(cluster, client, core, task, 0)
            assert settler.run_once() == 2            # both PS told
            for s in cluster.shards:                  # compacted: nothing live
                assert len(s.ledger) == 0 and s.ledger.closed.contains_range(
                    first[0].task_id, first[-1].task_id + 1)
                shard_ckpt.save_shard(s, ckpt)           # version 6, after compaction
            assert settler.run_once() == 0            # unchanged: nothing re-sent
            # a straggler holding a closed task finds it whole on every PS
            assert client.task_applied(first[0].task_id)[::2] == ({}, True)
            assert settler.settled_version == 6
            after = core.get(0)                       # closed and settled after version 6
            _train(cluster, client, core, after, 0)
            settler.run_once()
            partial = core.get(1)                     # its holder dies after minibatch 1
            _train(cluster, client, core, partial, 1, mbs=[1])
            gen_before, closed_before = core.closed_tasks()
            # a PS dies: every PS rolls back to version 6
            result = ps_rollback.rollback_all(cluster.addrs, 6, timeout_s=30)
            assert result.closed.contains_range(first[0].task_id, first[-1].task_id + 1)
            assert result.applied == {}
            lost = core.rollback(result.applied, result.new_version, closed=result.closed)
            assert lost == [after.task_id]            # closed after 6: re-opened
            # a settle computed before the rollback arrives late: ignored by every PS
            for addr in cluster.addrs:
                with grpc.insecure_channel(addr) as ch:
                    resp = pb_grpc.PServerStub(ch).settle(pb.SettleRequest(
                        generation=gen_before, closed=closed_before.to_flat()), timeout=10)
                    assert not resp.accepted
            for s in cluster.shards:
                assert after.task_id not in s.ledger.closed
            core.recover_tasks(1)                     # the dead holder's task
            settler.run_once()
            while not core.finished():
                task = core.get(2)
                assert task.type == TaskType.TRAINING
                _train(cluster, client, core, task, 2)
                settler.run_once()
            for s in cluster.shards:
                assert len(s.ledger) == 0             # all closed
                assert s.ledger.closed.num_intervals == 1
        finally:
            client.close()
            settler.stop()
        counts = _counts(cluster)
    for name, c in counts.items():   # every record applied exactly once, on every PS
        assert torch.equal(c, torch.ones(N)), (name, c.tolist())
    assert [e["records_applied"] for e in tm.epochs_report()] == [N]


def test_settler_tolerates_a_ps_that_is_down(tmp_path):
    tm = TaskManager([("ids", 0, 8)], records_per_task=PER_TASK, num_epochs=1)
    core = JobCore.for_tasks(tm, minibatch_size=MB)
    with local_ps(2, optimizer=lambda p: CountUpdates(p)) as cluster:
        _init(cluster)
        client = PSClient(cluster.addrs, rpc_timeout_s=20, reconnect_timeout_s=20)
        settler = Settler(core, cluster.addrs, "", rpc_timeout_s=1)
        try:
            task = core.get(0)
            _train(cluster, client, core, task, 0)
            cluster.stop(1)
            assert settler.run_once() == 1            # PS 0 told; PS 1 retried later
            assert cluster.shards[0].ledger.closed == IntervalSet([(task.task_id,
                                                                    task.task_id + 1)])
        finally:
            client.close()
            settler.stop()
