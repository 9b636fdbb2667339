"""The items reproduced in issue 12, each over real gRPC on 127.0.0.1 (no token here;
tests/unit/common/test_security.py covers the token): checkpoint path poisoning, tiny
chunks, rendezvous takeover, reports from non-holders, metrics for unknown
versions/tasks, MemoryError and internal errors as clear statuses."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import grpc
import pytest
import torch

from elasticdl.checkpoint.single import mark_done, save_file, version_dir
from elasticdl.cluster.process import free_port
from elasticdl.common.task import TaskType
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.job import JobCore
from elasticdl.master.rendezvous import Rendezvous
from elasticdl.master.servicer import MasterServicer, start_master_server
from elasticdl.master.task_manager import TaskManager
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc
from elasticdl.ps.server import start_server
from elasticdl.ps.servicer import PServicer
from elasticdl.ps.shard import PSShard, ShardConfig


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def old_save_request(directory: str, version: int, keep_max: int) -> bytes:
    """A SaveCheckpointRequest as the old wire format had it (fields 1, 2, 3)."""
    d = directory.encode()
    return (b"\x0a" + _varint(len(d)) + d + b"\x10" + _varint(version) +
            b"\x18" + _varint(keep_max))


@contextlib.contextmanager
def ps_server(**config) -> Iterator[tuple[PSShard, grpc.Channel]]:
    shard = PSShard(ShardConfig(ps_id=0, num_ps=1, **config),
                    lambda p: torch.optim.SGD(p, lr=0.1))
    shard.initialize(3, {"w": torch.ones(256, 1024)}, {}, [])  # 1 MiB parameter
    server, port = start_server(PServicer(shard), 0, "127.0.0.1", max_workers=8)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield shard, channel
    finally:
        channel.close()
        server.stop(0).wait(5)


def test_save_checkpoint_ignores_a_callers_directory_version_and_retention(tmp_path):
    job_dir, victim = str(tmp_path / "job"), str(tmp_path / "victim")
    save_file({"x": 1}, os.path.join(version_dir(victim, 100), "ps-0-of-1.pt"))
    mark_done(victim, 100)
    with ps_server(checkpoint_dir=job_dir, keep_checkpoint_max=5) as (shard, channel):
        call = channel.unary_unary("/elasticdl.PServer/save_checkpoint",
                                   request_serializer=lambda b: b,
                                   response_deserializer=pb.SaveCheckpointResponse.FromString)
        resp = call(old_save_request(victim, 1_000_000_000, 1), timeout=30)
    # the victim directory is untouched: no poisoned "newest" version, version-100 kept
    assert sorted(os.listdir(victim)) == ["version-100"]
    assert resp.version == 3 and resp.path.startswith(job_dir)
    assert sorted(os.listdir(job_dir)) == ["version-3"]


def test_save_checkpoint_without_a_job_checkpoint_dir_is_refused(tmp_path):
    with ps_server() as (shard, channel):
        stub = pb_grpc.PServerStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.save_checkpoint(pb.SaveCheckpointRequest(), timeout=30)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "checkpoint_dir" in e.value.details()


@pytest.mark.parametrize("chunk_bytes", [1, 100, (64 << 10) - 1, (64 << 20) + 1, -5])
def test_pull_dense_chunks_bounds_the_chunk_size(chunk_bytes):
    with ps_server() as (shard, channel):
        stub = pb_grpc.PServerStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.pull_dense_chunks(pb.PullDenseRequest(version=-1,
                                                            chunk_bytes=chunk_bytes),
                                        timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "chunk_bytes must be in" in e.value.details()
        # the smallest legal size works: 1 MiB in 16 chunks of 64 KiB
        chunks = list(stub.pull_dense_chunks(pb.PullDenseRequest(version=-1,
                                                                 chunk_bytes=64 << 10),
                                             timeout=30))
        assert len(chunks) == 16 and all(len(c.chunk.content) == 64 << 10 for c in chunks)


def test_memory_error_and_internal_errors_map_to_clear_statuses_and_ps_keeps_serving():
    with ps_server() as (shard, channel):
        stub = pb_grpc.PServerStub(channel)
        shard.pull_embedding = _raiser(MemoryError())  # type: ignore[method-assign]
        shard.params.tables["t"] = None  # type: ignore[assignment]
        req = pb.PullEmbeddingRequest(table="t", ids=[1])
        # the table lookup itself breaks first: an internal error, not UNKNOWN
        with pytest.raises(grpc.RpcError) as e:
            stub.pull_embedding(req, timeout=30)
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert "internal error" in e.value.details()
        del shard.params.tables["t"]
        shard.snapshot_dense = _raiser(MemoryError())  # type: ignore[method-assign]
        with pytest.raises(grpc.RpcError) as e:
            stub.pull_dense(pb.PullDenseRequest(version=-1), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "out of memory" in e.value.details()
        assert stub.status(pb.Empty(), timeout=30).version == 3  # still serving


def _raiser(exc: BaseException):
    def fn(*args, **kwargs):
        raise exc
    return fn


@pytest.mark.parametrize("version", [-1, 4, 1 << 60])
def test_push_of_a_version_the_ps_never_made_changes_nothing(version):
    with ps_server() as (shard, channel):
        stub = pb_grpc.PServerStub(channel)
        before = shard.params.dense["w"].clone()
        grad = pb.Tensor(name="w", dtype="float32", shape=[256, 1024],
                         content=torch.ones(256, 1024).numpy().tobytes())
        req = pb.PushGradientsRequest(version=version, dense=[grad])
        try:
            resp = stub.push_gradients(req, timeout=30)
            assert not resp.accepted
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert torch.equal(shard.params.dense["w"], before) and shard.version == 3


# ---------------------------------------------------------------------- master
@contextlib.contextmanager
def master_server(tm: TaskManager, agg: EvaluationAggregator, core=None, rendezvous=None
                  ) -> Iterator[pb_grpc.MasterStub]:
    port = free_port()
    core = core or JobCore.for_tasks(tm, agg)
    server = start_master_server(MasterServicer(core, rendezvous), port, host="127.0.0.1")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.MasterStub(channel)
    finally:
        channel.close()
        server.stop(0)


def _code(fn, request) -> grpc.StatusCode:
    try:
        fn(request, timeout=30)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_join_cannot_take_over_a_live_worker_id():
    rdzv = Rendezvous("store", lambda: 4000, settle_s=0.0, initial_workers=1)
    with master_server(TaskManager(), EvaluationAggregator(), rendezvous=rdzv) as stub:
        plan = stub.join(pb.JoinRequest(worker_id=0, host="10.0.0.1", port=1), timeout=30)
        plan = stub.get_comm_plan(pb.CommPlanRequest(worker_id=0), timeout=30)
        assert plan.ready and plan.master_addr == "10.0.0.1"
        code = _code(stub.join, pb.JoinRequest(worker_id=0, host="evil", port=2))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        plan = stub.get_comm_plan(pb.CommPlanRequest(worker_id=0), timeout=30)
        assert plan.ready and plan.master_addr == "10.0.0.1"
        assert list(plan.peer_addresses) == ["10.0.0.1:1"]
        # the same address again is an idempotent retry
        assert stub.join(pb.JoinRequest(worker_id=0, host="10.0.0.1", port=1),
                         timeout=30).ready


def test_report_task_result_from_a_non_holder_is_refused():
    tm = TaskManager(training_shards=[("t", 0, 20)], records_per_task=10)
    with master_server(tm, EvaluationAggregator()) as stub:
        task = stub.get_task(pb.GetTaskRequest(worker_id=0), timeout=30)
        code = _code(stub.report_task_result,
                     pb.ReportTaskResultRequest(task_id=task.task_id, worker_id=1))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert tm.counts()["doing"] == 1 and tm.counts()["completed"] == 0
        code = _code(stub.report_task_result,
                     pb.ReportTaskResultRequest(task_id=task.task_id, worker_id=1,
                                                err_message="boom", fatal=True))
        assert code == grpc.StatusCode.PERMISSION_DENIED and tm.failure is None
        assert _code(stub.report_task_result, pb.ReportTaskResultRequest(
            task_id=99, worker_id=0)) == grpc.StatusCode.INVALID_ARGUMENT
        stub.report_task_result(pb.ReportTaskResultRequest(task_id=task.task_id,
                                                           worker_id=0), timeout=30)
        assert tm.counts()["completed"] == 1


def test_metrics_for_unknown_tasks_versions_or_from_non_holders_are_refused():
    tm = TaskManager(training_shards=[("t", 0, 20)], evaluation_shards=[("v", 0, 10)],
                     records_per_task=10)
    agg = EvaluationAggregator()
    tm.evaluation_done_callbacks.append(agg.complete)
    tm.create_evaluation_tasks(5)
    with master_server(tm, agg) as stub:
        task = stub.get_task(pb.GetTaskRequest(worker_id=0), timeout=30)
        assert task.type == int(TaskType.EVALUATION) and task.model_version == 5
        metric = [pb.MetricValue(name="acc", value=0.5, weight=10)]
        for req, want in [
            (pb.ReportEvaluationMetricsRequest(worker_id=0, task_id=task.task_id,
                                               model_version=999, metrics=metric),
             grpc.StatusCode.INVALID_ARGUMENT),
            (pb.ReportEvaluationMetricsRequest(worker_id=0, task_id=12345, model_version=5,
                                               metrics=metric),
             grpc.StatusCode.INVALID_ARGUMENT),
            (pb.ReportEvaluationMetricsRequest(worker_id=7, task_id=task.task_id,
                                               model_version=5, metrics=metric),
             grpc.StatusCode.PERMISSION_DENIED),
        ]:
            assert _code(stub.report_evaluation_metrics, req) == want
        assert agg._sums == {}  # nothing aggregated
        stub.report_evaluation_metrics(pb.ReportEvaluationMetricsRequest(
            worker_id=0, task_id=task.task_id, model_version=5, metrics=metric), timeout=30)
        stub.report_task_result(pb.ReportTaskResultRequest(task_id=task.task_id,
                                                           worker_id=0), timeout=30)
        assert agg.results == {5: {"acc": 0.5}}


def test_version_reports_count_only_from_workers_that_had_tasks():
    tm = TaskManager(training_shards=[("t", 0, 20)], records_per_task=10)
    core = JobCore.for_tasks(tm, minibatch_size=1)  # one task: up to 10 versions
    with master_server(tm, EvaluationAggregator(), core=core) as stub:
        stub.report_version(pb.ReportVersionRequest(worker_id=3, model_version=10 ** 9),
                            timeout=30)
        assert core.version == 0
        stub.get_task(pb.GetTaskRequest(worker_id=3), timeout=30)
        stub.report_version(pb.ReportVersionRequest(worker_id=3, model_version=4), timeout=30)
        assert core.version == 4


def test_master_internal_errors_are_clear_statuses_and_it_keeps_serving():
    tm = TaskManager(training_shards=[("t", 0, 20)], records_per_task=10)
    with master_server(tm, EvaluationAggregator()) as stub:
        tm.get = _raiser(MemoryError())  # type: ignore[method-assign]
        assert _code(stub.get_task, pb.GetTaskRequest(worker_id=0)) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        tm.get = _raiser(KeyError("x"))  # type: ignore[method-assign]
        assert _code(stub.get_task, pb.GetTaskRequest(worker_id=0)) == \
            grpc.StatusCode.INTERNAL
        stub.echo(pb.Empty(), timeout=30)


def test_a_reassigned_stragglers_first_holder_may_still_report_it():
    now = [0.0]
    tm = TaskManager(training_shards=[("t", 0, 10)], records_per_task=10, task_timeout_s=5,
                     clock=lambda: now[0])
    with master_server(tm, EvaluationAggregator()) as stub:
        first = stub.get_task(pb.GetTaskRequest(worker_id=0), timeout=30)
        now[0] = 10.0  # worker 0 straggles: the task goes to worker 1 as well
        second = stub.get_task(pb.GetTaskRequest(worker_id=1), timeout=30)
        assert second.task_id == first.task_id
        assert tm.held_task(first.task_id)[1] == {0, 1}
        assert _code(stub.report_task_result, pb.ReportTaskResultRequest(
            task_id=first.task_id, worker_id=2)) == grpc.StatusCode.PERMISSION_DENIED
        stub.report_task_result(pb.ReportTaskResultRequest(task_id=first.task_id,
                                                           worker_id=0), timeout=30)
        assert tm.counts()["completed"] == 1 and tm.finished()
