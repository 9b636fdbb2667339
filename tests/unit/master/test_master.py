"""Policy decisions, the job controller over a scripted cluster, and the master
gRPC service's validation (in-process server on 127.0.0.1)."""

from __future__ import annotations

import threading

import grpc
import pytest

from elasticdl.cluster.api import Phase, ReplicaEvent, ReplicaInfo, ReplicaType
from elasticdl.common.job_report import JobReport
from elasticdl.common.job_spec import job_spec_from_flags
from elasticdl.common.schedule import Schedule
from elasticdl.common.task import TaskType
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.job import JobCore
from elasticdl.master.job_controller import JobController
from elasticdl.master.policy import Action, RelaunchPolicy
from elasticdl.master.servicer import MasterServicer, start_master_server
from elasticdl.master.task_manager import TaskManager
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc
from elasticdl.worker.master_client import MasterClient
from tests.unit.fakes import ScriptedCluster

W = ReplicaType.WORKER


def ev(index, phase, code=None, reason="", typ=W):
    return ReplicaEvent(typ, index, phase, code, reason)


@pytest.mark.parametrize("event,failures,finishing,action", [
    (ev(0, Phase.SUCCEEDED, 0, "completed"), 0, False, Action.IGNORE),
    (ev(0, Phase.FAILED, -9, "killed"), 0, False, Action.RELAUNCH),
    (ev(0, Phase.FAILED, 137, "killed"), 0, False, Action.RELAUNCH),
    (ev(0, Phase.DELETED, None, "deleted"), 0, False, Action.RELAUNCH),
    (ev(0, Phase.FAILED, 1, "error"), 3, False, Action.RELAUNCH),
    (ev(0, Phase.FAILED, 1, "error"), 4, False, Action.DROP),
    (ev(0, Phase.FAILED, 137, "oom"), 4, False, Action.DROP),
    (ev(0, Phase.FAILED, -9, "killed"), 0, True, Action.IGNORE),
    (ev(0, Phase.FAILED, 1, "error", ReplicaType.PS), 1, False, Action.RELAUNCH),
    (ev(0, Phase.FAILED, 1, "error", ReplicaType.PS), 11, False, Action.FAIL_JOB),
])
def test_policy(event, failures, finishing, action):
    assert RelaunchPolicy(3, 10).decide(event, failures, finishing).action == action


def controller(tmp_path, records=100, **flags):
    spec = job_spec_from_flags("predict", {
        "model_zoo": "z", "model_def": "m.f", "prediction_data": "p", "output": str(tmp_path),
        "checkpoint_dir_for_init": "c", "num_workers": 2, "job_name": "j", **flags})
    tm = TaskManager(prediction_shards=[("p", 0, records)], records_per_task=10)
    cluster = ScriptedCluster()
    report = JobReport("j", "Local", "local", 2, 0, job_type="predict")
    core = JobCore(tm, report, job_type=spec.job_type)
    ctl = JobController(spec, cluster, core, "m:1", str(tmp_path), report_interval_s=0)
    return ctl, cluster, tm, report


def test_timeline_kill_relaunch_then_success(tmp_path):
    ctl, cluster, tm, report = controller(tmp_path)
    ctl.start()
    assert cluster.names() == ["worker-0", "worker-1"]
    held = tm.get(1)
    # timeline: worker-1 is SIGKILLed while holding a task
    cluster.pending.append(ev(1, Phase.FAILED, -9, "killed"))
    for e in cluster.poll_events(0):
        ctl.handle(e)
    assert cluster.names() == ["worker-0", "worker-1", "worker-2"]
    assert report.relaunches == [{"replica": "worker-1", "new_replica": "worker-2",
                                  "reason": "killed", "exit_code": -9}]
    # its task went back to the queue, and the rest of the job completes
    seen = []
    while (t := tm.get(2)).type == TaskType.PREDICTION:
        seen.append(t.start)
        tm.report(t.task_id, 2, True)
    assert held.start in seen and tm.finished()
    for i in (0, 2):
        cluster.pending.append(ev(i, Phase.SUCCEEDED, 0, "completed"))
    assert ctl.run(threading.Event()) == "succeeded"
    assert tm.prediction_report() == {"records_completed": 100, "records_redone": 10}


def test_every_worker_failing_fails_job_with_first_root_cause(tmp_path):
    ctl, cluster, tm, report = controller(tmp_path, relaunch_on_worker_failure=1)
    ctl.start()
    ctl.on_worker_failure(0, "ValueError: boom", "Traceback ... boom")
    timeline = [ev(0, Phase.FAILED, 1, "error"), ev(1, Phase.FAILED, 1, "error"),
                ev(2, Phase.FAILED, 1, "error"), ev(3, Phase.FAILED, 1, "error")]
    for e in timeline:
        ctl.handle(e)
    assert cluster.names() == ["worker-0", "worker-1", "worker-2", "worker-3"]
    assert ctl.run(threading.Event()) == "failed"
    assert report.failure["replica"] == "worker-0"
    assert "ValueError: boom" in report.failure["error"]
    assert report.failure["traceback"] == "Traceback ... boom"


def test_evaluation_triggered_by_versions(tmp_path):
    spec = job_spec_from_flags("train", {"model_zoo": "z", "model_def": "m.f",
                                         "training_data": "t", "evaluation_steps": 10,
                                         "distribution_strategy": "ParameterServerStrategy",
                                         "num_ps_pods": 2})
    tm = TaskManager([("t", 0, 100)], [("v", 0, 10)], records_per_task=10)
    cluster = ScriptedCluster()
    core = JobCore(tm, JobReport("j", "", "", 1, 2), Schedule(evaluation_steps=10),
                   minibatch_size=1)
    ctl = JobController(spec, cluster, core, "m:1", str(tmp_path))
    ctl.start()
    assert cluster.names() == ["ps-0", "ps-1", "worker-0"]
    assert any("--ps_addrs=ps-0.svc:7000,ps-1.svc:7001" in a
               for a in cluster.created[-1].command)
    first = core.get(0)
    assert first.type == TaskType.TRAINING
    core.on_version(0, 7)
    assert core.get(0).type == TaskType.TRAINING
    core.on_version(0, 13)  # crossed 10: due, but two training tasks are still held
    assert core.get(0).type == TaskType.WAIT
    core.report_task(first.task_id, 0, True, model_version=15)
    assert core.get(0).type == TaskType.WAIT
    core.report_task(first.task_id + 1, 0, True, model_version=18)
    # encoded the bug before: labelled 20 (the multiple) while the model was at 23;
    # now labelled with the version the model has when its evaluation starts
    task = core.get(0)
    assert task.type == TaskType.EVALUATION and task.model_version == 18


@pytest.fixture
def master_server():
    tm = TaskManager(prediction_shards=[("p", 0, 30)], records_per_task=10)
    agg = EvaluationAggregator()
    from elasticdl.cluster.process import free_port

    port = free_port()
    server = start_master_server(MasterServicer(JobCore.for_tasks(tm, agg)), port,
                                 host="127.0.0.1")
    yield tm, agg, f"127.0.0.1:{port}"
    server.stop(0)


def test_master_client_round_trip(master_server):
    tm, agg, addr = master_server
    client = MasterClient(addr, worker_id=4)
    tasks = []
    while (t := client.get_task()).type == TaskType.PREDICTION:
        tasks.append(t)
        client.report_task(t)
    assert [(t.start, t.end) for t in tasks] == [(0, 10), (10, 20), (20, 30)]
    assert t.type == TaskType.NONE and tm.finished()
    client.close()


@pytest.mark.parametrize("method,request_msg,needle", [
    ("get_task", pb.GetTaskRequest(worker_id=-1), "worker_id"),
    ("get_task", pb.GetTaskRequest(worker_id=0, task_type=pb.WAIT), "task type"),
    ("report_task_result", pb.ReportTaskResultRequest(worker_id=0, task_id=-5), "task_id"),
    ("report_evaluation_metrics", pb.ReportEvaluationMetricsRequest(
        worker_id=0, metrics=[pb.MetricValue(name="acc", value=float("nan"), weight=1)]),
     "not finite"),
    ("report_version", pb.ReportVersionRequest(worker_id=0, model_version=-2),
     "model_version"),
    ("join", pb.JoinRequest(worker_id=0, host="h", port=1), "no rendezvous"),
])
def test_invalid_requests_get_invalid_argument(master_server, method, request_msg, needle):
    _, _, addr = master_server
    with grpc.insecure_channel(addr) as ch:
        stub = pb_grpc.MasterStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            getattr(stub, method)(request_msg, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in e.value.details()
        stub.echo(pb.Empty(), timeout=10)  # still serving


def test_master_client_gives_up_on_dead_master():
    from elasticdl.cluster.process import free_port

    client = MasterClient(f"127.0.0.1:{free_port()}", 0, call_timeout_s=0.5,
                          unavailable_timeout_s=1.5)
    with pytest.raises(ConnectionError, match="unreachable"):
        client.get_task()
    client.close()


@pytest.mark.parametrize("finished, relaunched", [
    ({(ReplicaType.WORKER, 0): (Phase.SUCCEEDED, 0)}, False),   # done while no master watched
    ({(ReplicaType.WORKER, 0): (Phase.FAILED, 1)}, True),
    ({}, True),                                                  # the backend cannot tell
])
def test_adopt_a_worker_that_finished_while_the_master_was_down(tmp_path, finished,
                                                                relaunched):
    """A k8s real-tier run under load: worker-0 finished its last task while the master
    was down, and the new master relaunched it as killed (a replica replaced for nothing).
    A worker whose pod ended with exit 0 is handled as that exit."""
    ctl, cluster, _, report = controller(tmp_path)
    ctl.start()
    assert cluster.names() == ["worker-0", "worker-1"]
    lost = ctl.adopt([ReplicaInfo(ReplicaType.WORKER, 1, Phase.RUNNING)], finished)
    assert lost == (["worker-0"] if relaunched else [])
    assert (cluster.names() == ["worker-0", "worker-1", "worker-2"]) == relaunched
    assert bool(report.relaunches) == relaunched, report.relaunches
