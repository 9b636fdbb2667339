"""The worker process builds the runtime registered for the job's strategy
(elasticdl.worker.runtime.runtime_class) and calls it through the WorkerRuntime ABC: a
fake runtime registered for a strategy runs a real job against a real master gRPC
server; and the built-in runtimes are the ones registered."""

from __future__ import annotations

import json
import os
import sys
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

from elasticdl.common.enums import JobType, Strategy
from elasticdl.common.job_spec import job_spec_from_flags
from elasticdl.common.task import TaskType
from elasticdl.common.wire import task_to_proto
from elasticdl.data.datasets import create_readers, shards_for
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.task_manager import TaskManager
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc
from elasticdl.worker import runtime as runtime_module
from elasticdl.worker.main import WorkerArgs, run_worker
from elasticdl.worker.runtime import (
    AllreduceRuntime,
    LocalRuntime,
    PSRuntime,
    RuntimeContext,
    WorkerRuntime,
)
from tests.conftest import FIXTURE_ZOO
from tests.unit import fake_runtime


class RecordingMaster(pb_grpc.MasterServicer):
    """The Master gRPC service over a real TaskManager, recording what workers
    report (versions, failures, who exports). Self-contained so the test does
    not depend on how the master's own servicer is assembled."""

    def __init__(self, tm: TaskManager) -> None:
        self.tm = tm
        self.lock = threading.Lock()
        self.versions: list[int] = []
        self.failures: list[str] = []
        self.exporters: list[int] = []
        self.exported: list[tuple[int, str]] = []

    def get_task(self, request, context):
        task = self.tm.get(request.worker_id, None, request_id=request.request_id)
        msg = task_to_proto(task)
        with self.lock:
            if task.type == TaskType.NONE and self.tm.finished() and not self.exporters:
                self.exporters.append(request.worker_id)
                msg.extended_config["export_model"] = "true"
        return msg

    def report_task_result(self, request, context):
        self.tm.report(request.task_id, request.worker_id, not request.err_message,
                       request.err_message, request.err_traceback, request.fatal,
                       counters={c.name: c.value for c in request.counters})
        return pb.Empty()

    def report_evaluation_metrics(self, request, context):
        return pb.Empty()

    def report_version(self, request, context):
        with self.lock:
            self.versions.append(request.model_version)
        return pb.Empty()

    def report_failure(self, request, context):
        with self.lock:
            self.failures.append(request.err_message)
        return pb.Empty()

    def report_export(self, request, context):   # the export protocol's WRITTEN step
        with self.lock:
            self.exported.append((request.worker_id, request.path))
        return pb.Empty()


@pytest.fixture
def toy(tmp_path):
    sys.path.insert(0, FIXTURE_ZOO)
    from toy import linear

    linear.write_data(str(tmp_path / "train"), n=100)
    linear.reset()
    fake_runtime.EVENTS.clear()
    fake_runtime.FAIL_AFTER_STEPS[0] = 0
    yield linear, tmp_path
    fake_runtime.FAIL_AFTER_STEPS[0] = 0


@pytest.fixture
def fake_ps_runtime(monkeypatch):
    monkeypatch.setitem(runtime_module._TRAINING_RUNTIMES, Strategy.PS,
                        fake_runtime.FakeRuntime)


def _spec(tmp_path, **flags):
    return job_spec_from_flags("train", {
        "model_zoo": FIXTURE_ZOO, "model_def": "toy.linear.custom_model",
        "training_data": str(tmp_path / "train"), "minibatch_size": 16,
        "num_minibatches_per_task": 2, "num_epochs": 2, "num_workers": 1,
        "distribution_strategy": "ParameterServerStrategy", "evaluation_steps": 4,
        "output": str(tmp_path / "out"), "job_name": "fake", **flags})


def _run(spec):
    readers = create_readers(spec)
    tm = TaskManager(records_per_task=spec.records_per_task, num_epochs=spec.num_epochs,
                     **shards_for(readers, spec))
    master = RecordingMaster(tm)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_MasterServicer_to_server(master, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        code = run_worker(WorkerArgs(0, f"127.0.0.1:{port}", spec, ("127.0.0.1:1",),
                                     "127.0.0.1"))
    finally:
        server.stop(0)
    return code, tm, master


def test_worker_runs_the_registered_runtime(toy, fake_ps_runtime):
    linear, tmp = toy
    spec = _spec(tmp)
    code, tm, hooks = _run(spec)
    assert code == 0, hooks.failures
    assert tm.finished()
    # the fake trained every record once per epoch through the model module's feed
    assert sorted(linear.TRAINED) == sorted(list(range(100)) * 2)
    # built with the worker's context, run, exported (this worker claimed it), closed
    assert [e[0] for e in fake_runtime.EVENTS] == ["build", "run", "export", "close"]
    assert fake_runtime.EVENTS[0][1] == (0, ("127.0.0.1:1",))
    steps = fake_runtime.EVENTS[1][1]
    # 2 files of 50 records, tasks of 32 (32 + 18), minibatches of 16: 4 per file
    assert steps == 2 * 2 * 4
    with open(os.path.join(spec.output, "fake_model.json")) as f:
        exported = json.load(f)
    y = np.concatenate([np.load(os.path.join(tmp, "train", n))["y"]
                        for n in sorted(os.listdir(tmp / "train"))])
    assert exported["model"]["mean"] == pytest.approx(float(y.mean()), abs=1e-5)
    assert exported["model_version"] == steps
    # the final version reached the master (the runtime's, after run)
    assert hooks.versions and hooks.versions[-1] == steps
    assert hooks.exporters == [0]
    assert [w for w, _ in hooks.exported] == [0]   # the exporter reported it wrote the model


def test_a_failing_runtime_is_reported_and_closed(toy, fake_ps_runtime):
    _, tmp = toy
    fake_runtime.FAIL_AFTER_STEPS[0] = 3
    code, tm, hooks = _run(_spec(tmp))
    assert code == 1
    assert len(hooks.failures) == 1 and "fake step 3 failed" in hooks.failures[0]
    assert [e[0] for e in fake_runtime.EVENTS] == ["build", "close"]
    assert not os.path.exists(os.path.join(tmp, "out", "fake_model.json"))


def test_local_strategy_workers_do_not_train(toy):
    _, tmp = toy
    spec = _spec(tmp, distribution_strategy="Local")
    code, _, hooks = _run(spec)
    assert code == 1
    assert "does not run distributed workers" in hooks.failures[0]


@pytest.mark.parametrize("name,job_type,cls", [
    ("ParameterServerStrategy", JobType.TRAIN, PSRuntime),
    ("AllreduceStrategy", JobType.TRAIN, AllreduceRuntime),
    ("ParameterServerStrategy", JobType.EVALUATE, LocalRuntime),
    ("AllreduceStrategy", JobType.PREDICT, LocalRuntime),
    ("Local", JobType.EVALUATE, LocalRuntime),
])
def test_registry_names_the_builtin_runtimes(name, job_type, cls):
    spec = type("Spec", (), {"distribution_strategy": name, "job_type": job_type})()
    got = runtime_module.runtime_class(spec)  # type: ignore[arg-type]
    assert got is cls and issubclass(got, WorkerRuntime)


def test_local_workers_never_train():
    spec = type("Spec", (), {"distribution_strategy": "Local", "job_type": JobType.TRAIN})()
    with pytest.raises(ValueError, match="does not run distributed workers"):
        runtime_module.runtime_class(spec)  # type: ignore[arg-type]


def test_local_runtime_trains_exports_and_round_trips_its_state(toy):
    import torch

    from elasticdl.api.model_spec import load_from_job_spec
    from elasticdl.local.task_source import LocalTaskSource

    _, tmp = toy
    spec = _spec(tmp, distribution_strategy="Local", num_epochs=1)
    model_spec = load_from_job_spec(spec)
    readers = create_readers(spec)
    tm = TaskManager(records_per_task=spec.records_per_task, **shards_for(readers, spec))
    runtime = LocalRuntime.build(RuntimeContext(model_spec, spec, device=torch.device("cpu")))
    before = {k: v.clone() for k, v in runtime.state_dict()["model"].items()}
    versions: list[int] = []
    stats = runtime.run(LocalTaskSource(tm, EvaluationAggregator()), readers,
                        on_version=versions.append)
    assert stats.steps == 8 and versions == list(range(1, 9)) and tm.finished()
    state = runtime.state_dict()
    assert any(not torch.equal(before[k], state["model"][k]) for k in before)
    paths = runtime.export(str(tmp / "exported"))
    saved = torch.load(paths[0], weights_only=True)
    assert all(torch.equal(saved[k], state["model"][k].cpu()) for k in saved)
    other = LocalRuntime.build(RuntimeContext(model_spec, spec, device=torch.device("cpu")))
    other.load_state_dict(state)
    assert other.model_version == 8
    assert all(torch.equal(other.state_dict()["model"][k], state["model"][k]) for k in saved)
    runtime.close()


def test_ps_runtime_cannot_load_worker_state():
    runtime = PSRuntime.__new__(PSRuntime)
    with pytest.raises(RuntimeError, match="parameter servers"):
        runtime.load_state_dict({"model": {}})
