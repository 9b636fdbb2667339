"""Observability units: the torch-free TensorBoard writer (bounded queue, periodic
and explicit flush, close), the job core's listeners driving it, and the
Prometheus collector served over real HTTP and parsed with prometheus_client."""

from __future__ import annotations

import glob
import os
import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from elasticdl.common.job_report import JobReport
from elasticdl.common.schedule import Schedule
from elasticdl.common.task import TaskType
from elasticdl.master import observability
from elasticdl.master.job import JobCore
from elasticdl.master.prometheus_metrics import METRICS, task_counts
from elasticdl.master.task_manager import TaskManager
from elasticdl.master.tensorboard_events import ScalarEventWriter
from tests.integration.helpers import wait_for


def scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(logdir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def test_writer_writes_readable_scalars_on_flush(tmp_path):
    w = ScalarEventWriter(str(tmp_path), flush_secs=3600)
    for step in range(5):
        assert w.add_scalar("train/loss", 1.0 / (step + 1), step)
    assert w.flush()
    got = scalars(str(tmp_path))["train/loss"]
    assert [s for s, _ in got] == [0, 1, 2, 3, 4]
    assert [v for _, v in got] == pytest.approx([1.0, 0.5, 1 / 3, 0.25, 0.2])
    w.close()


def test_writer_flushes_periodically_without_being_asked(tmp_path):
    w = ScalarEventWriter(str(tmp_path), flush_secs=0.2)
    w.add_scalar("x", 3.0, 7)
    got = wait_for(lambda: scalars(str(tmp_path)).get("x"), 20, "a periodic flush")
    assert got == [(7, 3.0)]
    w.close()


def test_writer_queue_is_bounded_and_never_blocks(tmp_path):
    w = ScalarEventWriter(str(tmp_path), max_queue=3, flush_secs=3600)
    release, entered = threading.Event(), threading.Event()
    real_add = w._writer.add_event

    def stuck_add(event):  # the disk is slow: the writer thread sits on one event
        entered.set()
        release.wait(30)
        real_add(event)

    w._writer.add_event = stuck_add
    assert w.add_scalar("q", 0.0, 0)
    assert entered.wait(10)
    started = time.monotonic()
    results = [w.add_scalar("q", float(i), i) for i in range(1, 11)]
    assert time.monotonic() - started < 1.0  # no blocking on a full queue
    assert results == [True] * 3 + [False] * 7
    assert w.dropped == 7
    # rare scalars (evaluations...) are not lost to the burst: their own queue
    assert [w.add_scalar("eval/acc", 0.5 + i / 10, i, keep=True) for i in range(3)] == \
        [True] * 3
    # that queue is bounded too (by max_queue, 3 here)
    assert [w.add_scalar("eval/acc", 1.0, 9, keep=True) for _ in range(3)] == [False] * 3
    assert w.dropped == 10
    release.set()
    assert w.flush()
    got = scalars(str(tmp_path))
    assert [s for s, _ in got["q"]] == [0, 1, 2, 3]
    assert got["eval/acc"] == [(0, 0.5), (1, pytest.approx(0.6)), (2, pytest.approx(0.7))]
    w.close()


def test_close_writes_everything_and_is_final(tmp_path):
    w = ScalarEventWriter(str(tmp_path), flush_secs=3600)
    for i in range(100):
        w.add_scalar("a", float(i), i)
    w.close()
    assert not w._thread.is_alive()
    assert len(scalars(str(tmp_path))["a"]) == 100
    assert not w.add_scalar("a", 1.0, 101)  # closed: dropped, no error
    assert not w.flush()
    w.close()  # idempotent
    assert len(glob.glob(os.path.join(str(tmp_path), "events.out.tfevents.*"))) == 1


def make_core(epochs=2, train=120, val=30):
    tm = TaskManager([("t", 0, train)], [("v", 0, val)], records_per_task=20,
                     num_epochs=epochs, seed=3)
    return JobCore(tm, JobReport("obs-job", "ParameterServerStrategy", "local", 2, 1,
                             training_records=train, validation_records=val),
                   Schedule(), minibatch_size=10)


def run_job(core: JobCore, losses: list[float]) -> None:
    """One worker: training tasks report decreasing losses, the lr of their epoch and
    the version after them; evaluation tasks report accuracy = version / 100."""
    version = 0
    for _ in range(1000):
        if core.finished():
            return
        task = core.get(0)
        if task.type == TaskType.TRAINING:
            version += 2
            loss = 2.0 / version
            losses.append(loss)
            core.report_task(task.task_id, 0, True, model_version=version, loss=loss,
                             learning_rate=0.7 ** task.epoch)
        elif task.type == TaskType.EVALUATION:
            core.report_evaluation(task.task_id, task.model_version,
                                   [("accuracy", task.model_version / 100.0, task.num_records)])
            core.report_task(task.task_id, 0, True, model_version=version)
    raise AssertionError("job did not finish")


def test_tensorboard_series_from_a_job_core(tmp_path):
    core = make_core()
    obs = observability.attach(core, str(tmp_path), flush_secs=3600)
    losses: list[float] = []
    run_job(core, losses)
    core.report.add_relaunch("worker-0", "worker-2", "killed", -9)
    core.notify("on_relaunch", replica="worker-0", new_replica="worker-2", reason="killed",
                version=core.version)
    obs.close()
    s = scalars(os.path.join(str(tmp_path), observability.TENSORBOARD_DIR))
    loss = s["train/loss"]
    assert [v for _, v in loss] == pytest.approx(losses)
    steps = [st for st, _ in loss]
    assert steps == sorted(steps) and steps[0] == 2 and steps[-1] == 24
    assert sorted({v for _, v in s["train/learning_rate"]}) == pytest.approx([0.7, 1.0])
    # one evaluation per epoch end, at the version it evaluated
    assert s["eval/accuracy"] == [(12, pytest.approx(0.12)), (24, pytest.approx(0.24))]
    assert [v for _, v in s["job/epochs_completed"]] == [0, 1, 2]
    assert [v for _, v in s["job/relaunches"]] == [0, 1]


def test_a_failing_listener_does_not_fail_the_job():
    core = make_core(epochs=1)

    class Broken(observability.JobListener):
        def on_training_task(self, *a, **k):
            raise RuntimeError("boom")

    core.add_listener(Broken())
    run_job(core, [])
    assert core.finished()
    assert core.tm.epochs_report()[0]["records_completed"] == 120


def scrape(address: str) -> dict[str, dict[tuple, float]]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = \
                sample.value
    return out


def test_prometheus_endpoint_serves_the_job_figures():
    core = make_core()
    obs = observability.attach(core, "", metrics_port=0, track_ps=True)
    try:
        m = scrape(obs.address)
        assert m["elasticdl_model_version"][()] == 0
        assert m["elasticdl_tasks"][(("state", "todo"), ("type", "training"))] == 12
        assert not m.get("elasticdl_relaunches_total")
        held = core.get(0)
        m = scrape(obs.address)
        assert m["elasticdl_tasks"][(("state", "doing"), ("type", "training"))] == 1
        core.report_task(held.task_id, 0, True, model_version=2, loss=0.5,
                         learning_rate=0.1)
        run_job(core, [])
        core.notify("on_replica", kind="ps", index=0, alive=True)
        core.report.add_relaunch("worker-0", "worker-2", "killed", -9)
        core.report.add_relaunch("ps-0", "ps-0", "oom", 137)
        m = scrape(obs.address)
    finally:
        obs.close()
    for name, (typ, labels) in METRICS.items():
        sample = name + ("_total" if typ == "counter" else "")
        if labels and not m.get(sample):
            continue
        assert sample in m, sample
    assert m["elasticdl_epoch_records_completed"] == {(("epoch", "0"),): 120,
                                                      (("epoch", "1"),): 120}
    assert m["elasticdl_epochs_completed"][()] == 2
    assert m["elasticdl_tasks"][(("state", "done"), ("type", "training"))] == 12
    assert m["elasticdl_tasks"][(("state", "done"), ("type", "evaluation"))] == 4
    assert m["elasticdl_tasks"][(("state", "todo"), ("type", "training"))] == 0
    assert m["elasticdl_model_version"][()] == core.version
    last = core.report.evaluations[-1]
    assert m["elasticdl_evaluation_model_version"][()] == last["model_version"]
    assert m["elasticdl_evaluation_metric"][(("metric", "accuracy"),)] == \
        pytest.approx(last["metrics"]["accuracy"])
    assert m["elasticdl_evaluations_total"][()] == 2
    assert m["elasticdl_relaunches_total"] == {
        (("reason", "killed"), ("replica_type", "worker")): 1,
        (("reason", "oom"), ("replica_type", "ps")): 1}
    assert m["elasticdl_training_loss"][()] == pytest.approx(2.0 / 22)
    assert m["elasticdl_learning_rate"][()] == pytest.approx(0.7)
    assert m["elasticdl_training_records_per_second"][()] > 0
    assert m["elasticdl_ps_alive"][()] == 1
    assert m["elasticdl_ps_requested"][()] == 1


def test_metrics_server_stops_and_frees_its_port():
    core = make_core()
    obs = observability.attach(core, "", metrics_port=0)
    address = obs.address
    obs.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{address}/metrics", timeout=5)


def _hold_a_port() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock, sock.getsockname()[1]


def test_a_fresh_job_fails_at_once_on_a_metrics_port_in_use():
    sock, port = _hold_a_port()
    try:
        start = time.monotonic()
        with pytest.raises(observability.ObservabilityError, match="--metrics_port"):
            observability.attach(make_core(), "", metrics_port=port)
        assert time.monotonic() - start < 5
    finally:
        sock.close()


def test_a_restored_master_waits_for_its_predecessor_to_free_the_port():
    # the replacement master pod can start while the one it replaces still serves
    sock, port = _hold_a_port()
    threading.Timer(1.5, sock.close).start()
    obs = observability.attach(make_core(), "", metrics_port=port, fresh=False)
    try:
        assert obs.address.endswith(f":{port}")
        body = urllib.request.urlopen(f"http://{obs.address}/metrics", timeout=5).read()
        assert b"elasticdl_model_version" in body
    finally:
        obs.close()


def test_task_counts_include_epochs_not_created_yet():
    core = make_core(epochs=3)
    counts = task_counts(core.tm)
    assert counts[("training", "todo")] == 18
    assert counts[("evaluation", "todo")] == 0


NO_TORCH = r'''
import sys, tempfile, urllib.request
import elasticdl.master.main  # noqa: F401  (the master's imports)
from elasticdl.common.job_report import JobReport
from elasticdl.master import observability
from elasticdl.master.job import JobCore
from elasticdl.master.task_manager import TaskManager
tm = TaskManager([("t", 0, 40)], [], records_per_task=20)
core = JobCore(tm, JobReport("j", "ParameterServerStrategy", "local", 1, 1))
obs = observability.attach(core, tempfile.mkdtemp(), metrics_port=0, track_ps=True)
t = core.get(0)
core.report_task(t.task_id, 0, True, model_version=1, loss=0.5, learning_rate=0.1)
urllib.request.urlopen(f"http://{obs.address}/metrics", timeout=10).read()
obs.close()
bad = sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "tensorflow"))
print("IMPORTED:", bad)
sys.exit(1 if bad else 0)
'''


def test_observability_never_imports_torch():
    import subprocess
    import sys

    from tests.conftest import ROOT

    r = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_restored_master_appends_without_duplicating(tmp_path):
    """Failover: the first master dies mid-job (its events flushed), a second one
    restores the core from its state and writes a second file in the same dir;
    TensorBoard reads one series: each task's loss once, each evaluation once,
    counters going on from the restored state."""
    first = make_core()
    obs = observability.attach(first, str(tmp_path), flush_secs=3600)
    version, losses = 0, []
    for _ in range(8):  # 8 of 12 training tasks (epoch 0 ends, its evaluation runs)
        task = first.get(0)
        while task.type == TaskType.EVALUATION:
            first.report_evaluation(task.task_id, task.model_version,
                                    [("accuracy", 0.5, task.num_records)])
            first.report_task(task.task_id, 0, True, model_version=version)
            task = first.get(0)
        version += 2
        losses.append(2.0 / version)
        first.report_task(task.task_id, 0, True, model_version=version, loss=losses[-1])
    first.report.add_relaunch("worker-0", "worker-1", "killed", -9)
    first.notify("on_relaunch", replica="worker-0", new_replica="worker-1", reason="killed",
                 version=first.version)
    obs.flush()
    state = first.state_dict()
    obs.close()
    second = make_core()
    second.load_state_dict(state)
    obs2 = observability.attach(second, str(tmp_path), fresh=False, flush_secs=3600)
    for _ in range(1000):
        if second.finished():
            break
        task = second.get(1)
        if task.type == TaskType.TRAINING:
            version += 2
            losses.append(2.0 / version)
            second.report_task(task.task_id, 1, True, model_version=version,
                               loss=losses[-1])
        elif task.type == TaskType.EVALUATION:
            second.report_evaluation(task.task_id, task.model_version,
                                     [("accuracy", 0.9, task.num_records)])
            second.report_task(task.task_id, 1, True, model_version=version)
    obs2.close()
    logdir = os.path.join(str(tmp_path), observability.TENSORBOARD_DIR)
    assert len(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))) == 2
    s = scalars(logdir)
    assert [v for _, v in s["train/loss"]] == pytest.approx(losses)
    assert [st for st, _ in s["train/loss"]] == list(range(2, 26, 2))
    assert s["eval/accuracy"] == [(12, 0.5), (24, pytest.approx(0.9))]
    assert s["job/epochs_completed"][-1][1] == 2
    assert [v for _, v in s["job/relaunches"]] == [0, 1, 1]  # the restored count goes on


def test_master_service_exposes_the_metrics_port():
    from elasticdl.cluster.k8s_master import master_service
    from elasticdl.common.job_spec import JobSpecError, job_spec_from_flags

    def ports(**flags):
        spec = job_spec_from_flags("train", {"model_zoo": "z", "model_def": "m.f",
                                             "training_data": "d", "image_name": "i",
                                             **flags})
        return {p["name"]: p["port"] for p in master_service(spec, 50001)["spec"]["ports"]}

    assert ports() == {"grpc": 50001, "metrics": 51001}
    assert ports(metrics_port=9300) == {"grpc": 50001, "metrics": 9300}
    assert ports(metrics_port=-1) == {"grpc": 50001}
    for bad in (-2, 70000):
        with pytest.raises(JobSpecError, match="--metrics_port"):
            ports(metrics_port=bad)


def test_a_fresh_job_replaces_earlier_series_a_restored_one_keeps_them(tmp_path):
    for fresh, files in ((True, 1), (True, 1), (False, 2)):
        core = make_core(epochs=1)
        obs = observability.attach(core, str(tmp_path), fresh=fresh, flush_secs=3600)
        run_job(core, [])
        obs.close()
        logdir = os.path.join(str(tmp_path), observability.TENSORBOARD_DIR)
        assert len(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))) == files
        assert len(scalars(logdir)["train/loss"]) == 6 * files


def test_unusable_port_or_directory_is_a_clear_error(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(observability.ObservabilityError, match="--metrics_port"):
            observability.attach(make_core(), "", metrics_port=port)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(observability.ObservabilityError, match="--output"):
        observability.attach(make_core(), str(blocker))
