"""Training semantics of the parameter server (issue 10, items 1-4, 9-12): every
gradient applied exactly once, weighted by records, never silently dropped.

Each test names the item it covers and inspects parameters (against a
single-process reference where one exists), not counters.
"""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest
import torch

from elasticdl.api.model_spec import load_model_spec
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.tables import TableSpec
from elasticdl.common.task import TaskType
from elasticdl.data.api import DataReader, Shard
from elasticdl.local.task_source import LocalTaskSource
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.task_manager import TaskManager
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc
from elasticdl.ps.shard import GradientPush, NotInitializedError, PSShard, ShardConfig
from elasticdl.worker.ps_client import PSClient
from elasticdl.worker.ps_trainer import PSTrainer
from elasticdl.worker.task_loop import TaskLoop
from elasticdl.worker.trainer import LocalTrainer
from tests.conftest import FIXTURE_ZOO
from tests.unit.ps_helpers import local_ps, push_together, sgd

MODEL_DEF = "toy.ctr.custom_model"  # SGD lr 0.1, an embedding table and a linear head
W = torch.arange(6, dtype=torch.float32).reshape(2, 3)
TABLE = TableSpec(name="emb.weight", num_embeddings=100, dim=4, initializer="normal:0.1",
                  seed=7)


def _shard(factory=None, **config) -> PSShard:
    return PSShard(ShardConfig(**config), factory or sgd(0.1))


class ListReader(DataReader):
    """Records in memory (one shard)."""

    def __init__(self, records: list[dict[str, Any]]):
        self.records = records

    def create_shards(self) -> list[Shard]:
        return [Shard("mem", 0, len(self.records))]

    def read(self, name: str, start: int, end: int) -> list[Any]:
        return self.records[start:end]


def _records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(0, 100, size=3)
        x = rng.normal(size=2).astype(np.float32)
        out.append({"ids": ids, "x": x, "y": float((ids[0] % 2 == 0) ^ (x[0] > 0))})
    return out


def _job(**kw) -> JobSpec:
    return JobSpec(model_zoo=FIXTURE_ZOO, model_def=MODEL_DEF, training_data="unused",
                   distribution_strategy="ParameterServerStrategy", seed=3, **kw)


def _trainer(addrs: list[str], job: JobSpec, worker_id: int) -> PSTrainer:
    client = PSClient(addrs, rpc_timeout_s=20, reconnect_timeout_s=5)
    return PSTrainer(load_model_spec(FIXTURE_ZOO, MODEL_DEF), addrs, job, worker_id,
                     torch.device("cpu"), client=client, init_timeout_s=20)


def _assert_state_equal(ps_state: dict, ref_state: dict) -> None:
    assert set(ps_state) == set(ref_state)
    for name, value in ref_state.items():
        assert torch.allclose(ps_state[name], value, atol=1e-5, rtol=0), name


# ------------------------------------------------------------------ item 1
def test_item1_init_is_atomic_and_names_the_optimizer_and_table():
    shard = _shard(lambda p: torch.optim.RMSprop(p, lr=0.1))
    with pytest.raises(ValueError, match=r"emb\.weight.*RMSprop"):
        shard.initialize(0, {"w": W}, {}, [TABLE])
    assert not shard.initialized  # all or nothing: nobody trains on a half-built PS
    with pytest.raises(NotInitializedError):
        shard.push_gradients(GradientPush(version=0, dense={"w": torch.ones(2, 3)}))
    bad = _shard(lambda p: object())
    with pytest.raises(ValueError, match="not a torch.optim.Optimizer"):
        bad.initialize(0, {"w": W}, {}, [])
    assert not bad.initialized


def test_item1_push_model_over_grpc_fails_clearly_and_leaves_ps_uninitialised():
    with local_ps(1, lambda p: torch.optim.RMSprop(p, lr=0.1)) as cluster:
        client = PSClient(cluster.addrs, rpc_timeout_s=10, reconnect_timeout_s=2)
        try:
            with pytest.raises(ValueError, match=r"RMSprop"):
                client.push_model(0, {"w": W}, {}, [TABLE])
            assert [s.initialized for s in client.status()] == [False]
        finally:
            client.close()


# ------------------------------------------------------------------ item 2
def test_item2_lone_sync_push_is_applied_not_dropped():
    shard = _shard(grads_to_wait=2, sync_wait_s=0.3, sync_wait_min_s=0.1)
    shard.initialize(0, {"w": W}, {}, [])
    g = torch.ones(2, 3)
    result = shard.push_gradients(GradientPush(version=0, dense={"w": g}, task_id=1,
                                               minibatch=1, num_records=5))
    assert result.accepted
    # the group could not fill (no peer): applied as it is once the wait expired
    assert torch.allclose(shard.params.dense["w"].detach(), W - 0.1 * g)
    assert shard.version == 1
    assert [e[:2] for e in shard.ledger.entries()] == [(1, 1)]


# ------------------------------------------------------------------ item 3
def test_item3_sync_group_weights_by_records_like_the_union_batch():
    torch.manual_seed(0)
    x = torch.randn(4, 3)
    y = torch.randn(4)
    w0 = torch.randn(3)

    def grad(rows: slice) -> torch.Tensor:
        w = w0.clone().requires_grad_(True)
        ((x[rows] @ w - y[rows]) ** 2).mean().backward()
        return w.grad

    shard = _shard(grads_to_wait=2, sync_wait_s=30)
    shard.initialize(0, {"w": w0}, {}, [])
    pushes = [GradientPush(version=0, worker_id=1, dense={"w": grad(slice(0, 1))},
                           task_id=1, minibatch=1, num_records=1),
              GradientPush(version=0, worker_id=2, dense={"w": grad(slice(1, 4))},
                           task_id=2, minibatch=1, num_records=3)]
    push_together(shard, pushes)
    assert shard.version == 1
    expected = w0 - 0.1 * grad(slice(0, 4))  # one step on the union batch of 4 records
    assert torch.allclose(shard.params.dense["w"].detach(), expected, atol=1e-6)


# ------------------------------------------------------------------ item 4
def test_item4_worker_dying_after_push_before_report_applies_each_minibatch_once():
    spec = load_model_spec(FIXTURE_ZOO, MODEL_DEF)
    records = _records(16)
    reader = ListReader(records)
    job = _job(num_ps_pods=2, minibatch_size=4)
    tm = TaskManager(reader.create_shards(), records_per_task=16)
    with local_ps(2, sgd(0.1)) as cluster:
        dead = _trainer(cluster.addrs, job, 0)
        survivor = _trainer(cluster.addrs, job, 1)
        try:
            task = tm.get(0)
            assert dead.start_task(task) == frozenset()
            for k in (1, 2):  # two minibatches pushed and applied, then kill -9
                dead.set_position(task.task_id, k, 4)
                dead.train_minibatch(*spec.feed(records[4 * (k - 1):4 * k], "training"))
            assert tm.recover_tasks(0) == [task]  # re-queued as a dead worker's task
            loop = TaskLoop(LocalTaskSource(tm, EvaluationAggregator(), worker_id=1),
                            survivor, spec, {TaskType.TRAINING: reader}, minibatch_size=4,
                            worker_id=1)
            loop.run()
            assert loop.stats.steps == 2  # resumed after the applied minibatches
            ps_state = survivor.state_dict_from_ps()
        finally:
            dead.close()
            survivor.close()
        for shard in cluster.shards:
            idents = [e[:2] for e in shard.ledger.entries()]
            assert sorted(idents) == [(task.task_id, k) for k in (1, 2, 3, 4)]
    assert tm.epochs_report()[0]["records_applied"] == 16
    ref = LocalTrainer(spec, torch.device("cpu"), seed=job.seed)
    for k in range(4):
        ref.train_minibatch(*spec.feed(records[4 * k:4 * k + 4], "training"))
    _assert_state_equal(ps_state, {n: t.detach() for n, t in ref.model.state_dict().items()})


def test_item4_repeated_identity_is_ignored_and_task_short_of_applied_is_requeued():
    shard = _shard()
    shard.initialize(0, {"w": W}, {}, [])
    push = GradientPush(version=0, dense={"w": torch.ones(2, 3)}, task_id=7, minibatch=1,
                        num_records=2)
    assert not shard.push_gradients(push).duplicate
    again = shard.push_gradients(GradientPush(version=1, dense={"w": torch.ones(2, 3)},
                                              task_id=7, minibatch=1, num_records=2))
    assert again.duplicate and shard.version == 1
    assert torch.allclose(shard.params.dense["w"].detach(), W - 0.1)  # applied once
    tm = TaskManager([("a", 0, 8)], records_per_task=8)
    t = tm.get(1)
    tm.report(t.task_id, 1, True, counters={"records_applied": 4})
    assert tm.epochs_report()[0]["records_completed"] == 0  # not counted: re-queued
    assert tm.get(2).task_id == t.task_id


# ------------------------------------------------------------------ item 9
def test_item9_nonfinite_gradients_rejected_naming_the_parameter():
    shard = _shard()
    shard.initialize(0, {"w": W}, {}, [TABLE])
    bad = torch.ones(2, 3)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"'w'.*NaN"):
        shard.push_gradients(GradientPush(version=0, dense={"w": bad}))
    rows = torch.full((1, 4), float("inf"))
    with pytest.raises(ValueError, match=r"emb\.weight.*Inf"):
        shard.push_gradients(GradientPush(version=0, sparse=[("emb.weight", np.array([3]),
                                                               rows)]))
    assert torch.equal(shard.params.dense["w"].detach(), W) and shard.version == 0


def test_item9_client_cannot_change_the_learning_rate():
    with local_ps(1, sgd(0.1)) as cluster:
        client = PSClient(cluster.addrs, rpc_timeout_s=10, reconnect_timeout_s=2)
        try:
            client.push_model(0, {"w": W}, {}, [])
            stub = pb_grpc.PServerStub(grpc.insecure_channel(cluster.addrs[0]))
            from elasticdl.common import tensor_codec as codec

            req = pb.PushGradientsRequest(version=0, learning_rate=100.0,
                                          dense=[codec.encode(torch.ones(2, 3), "w")])
            with pytest.raises(grpc.RpcError) as info:
                stub.push_gradients(req, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "learning rate" in info.value.details()
            assert torch.equal(cluster.shards[0].params.dense["w"].detach(), W)
        finally:
            client.close()


def test_item9_nan_training_fails_the_job_after_max_task_retries_naming_it():
    spec = load_model_spec(FIXTURE_ZOO, MODEL_DEF)
    records = _records(8)
    for r in records:
        r["x"] = np.array([np.nan, 1.0], dtype=np.float32)
    reader = ListReader(records)
    tm = TaskManager(reader.create_shards(), records_per_task=8, max_task_retries=2)
    with local_ps(1, sgd(0.1)) as cluster:
        trainer = _trainer(cluster.addrs, _job(minibatch_size=4), 0)
        try:
            # the worker sees the NaN loss before anything is pushed: each attempt
            # fails its task (the worker goes on), the second one fails the job
            loop = TaskLoop(LocalTaskSource(tm, EvaluationAggregator()), trainer, spec,
                            {TaskType.TRAINING: reader}, minibatch_size=4)
            loop.run()
        finally:
            trainer.close()
        assert cluster.shards[0].version == 0  # nothing applied
    assert tm.failure is not None and tm.failure.attempts == 2
    assert "non-finite loss (nan) at step" in tm.failure.describe()


# ----------------------------------------------------------------- item 11
def test_item11_embedding_index_is_lazy(tmp_path):
    """A 2^31-row table: nothing allocated before rows exist; 10^5 rows touched
    stay far under 200 MB (the process RSS is measured in
    benchmarks/ps_memory.py; here the index and rows themselves)."""
    from elasticdl.ps.parameters import EmbeddingTable

    table = EmbeddingTable(TableSpec(name="big", num_embeddings=1 << 31, dim=8), 0, 1)
    assert table._index.nbytes == 0
    ids = np.unique(np.random.default_rng(0).integers(0, 1 << 31, size=100_000))
    rows = table.lookup(ids)
    assert rows.shape == (ids.shape[0], 8)
    again = table.lookup(ids[::-1].copy())
    assert torch.equal(again, rows.flip(0))
    assert table.nbytes < 20 * 1024 * 1024   # rows over reserved space: those in use


# ----------------------------------------------------------------- item 12
def test_item12_hung_first_task_is_reassigned_without_three_durations():
    now = [0.0]
    tm = TaskManager([("a", 0, 20)], records_per_task=10, clock=lambda: now[0],
                     initial_task_timeout_s=600)
    hung = tm.get(1)
    other = tm.get(2)
    assert tm.get(3).type == TaskType.WAIT
    now[0] = 5.0
    tm.report(other.task_id, 2, True)  # one duration known, not three
    assert tm.get(3).type == TaskType.WAIT
    now[0] = 601.0
    again = tm.get(3)  # the hung worker's task goes to another worker
    assert (again.start, again.end) == (hung.start, hung.end)


def test_item12_get_task_retry_after_lost_reply_orphans_nothing():
    from elasticdl.cluster.process import free_port
    from elasticdl.master.job import JobCore
    from elasticdl.master.servicer import MasterServicer, start_master_server
    from elasticdl.worker.master_client import MasterClient

    tm = TaskManager([("a", 0, 40)], records_per_task=10)

    class LossyServicer(MasterServicer):
        lost = 0

        def get_task(self, request, context):
            reply = super().get_task(request, context)
            if LossyServicer.lost == 0:  # the task was handed out but the reply is lost
                LossyServicer.lost += 1
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "reply lost")
            return reply

    port = free_port()
    server = start_master_server(LossyServicer(JobCore.for_tasks(tm, EvaluationAggregator())),
                                 port, host="127.0.0.1")
    try:
        addr = f"127.0.0.1:{port}"
        client = MasterClient(addr, worker_id=1, call_timeout_s=10, unavailable_timeout_s=20)
        try:
            first = client.get_task()
            assert LossyServicer.lost == 1
            assert tm.counts()["doing"] == 1  # the retry got the same task, none orphaned
            client.report_task(first)
            second = client.get_task()
            assert second.task_id != first.task_id and tm.counts()["doing"] == 1
        finally:
            client.close()
    finally:
        server.stop(0).wait(5)


def test_item11_ps_process_rss_with_a_2_31_row_table_stays_under_200mb():
    """A real PS process (gRPC): a 2^31-row table, 10^5 rows pulled and pushed (Adam
    row state); its resident memory grows by far less than 200 MB."""
    import importlib
    import sys

    from tests.conftest import ROOT

    bench = f"{ROOT}/benchmarks"
    if bench not in sys.path:
        sys.path.append(bench)  # spawned children inherit sys.path: ps_memory.ps_server
    m = importlib.import_module("ps_memory").measure(1 << 31, 100_000, 8)
    assert m["rows"] > 99_000
    assert m["touched_mb"] - m["before_mb"] < 200, m


def test_item4_identity_and_records_travel_on_unary_and_streamed_pushes():
    with local_ps(1, sgd(0.1)) as cluster:
        client = PSClient(cluster.addrs, rpc_timeout_s=10, reconnect_timeout_s=2,
                          chunk_bytes=8)
        try:
            client.push_model(0, {"w": W}, {}, [])
            g = torch.ones(2, 3)
            assert client.push_gradients(0, 0, {"w": g}, identity=(5, 1, 3)).result() == \
                (True, 1)
            stream = client.open_push_stream(0, 1, identity=(5, 2, 4))
            stream.put_dense("w", g)
            assert stream.finish() == (True, 2)
            stream = client.open_push_stream(0, 2, identity=(5, 2, 4))  # a repeat
            stream.put_dense("w", g)
            assert stream.finish() == (True, 2)
            assert [(t, mb, n) for t, mb, n, _ in cluster.shards[0].ledger.entries()] == \
                [(5, 1, 3), (5, 2, 4)]
            assert torch.allclose(cluster.shards[0].params.dense["w"].detach(), W - 0.2)
            assert client.applied_minibatches(5) == ({1: 3, 2: 4}, 2)
        finally:
            client.close()


def test_item4_task_whose_reader_returned_fewer_records_counts_what_was_read():
    tm = TaskManager([("a", 0, 8)], records_per_task=8)
    t = tm.get(1)
    tm.report(t.task_id, 1, True, counters={"records_applied": 6, "records_read": 6})
    assert tm.finished()  # not re-queued forever
    assert tm.epochs_report()[0]["records_applied"] == 6
