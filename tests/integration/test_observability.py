"""Observability of real jobs on digits: the master of a ``--cluster=local``
ParameterServerStrategy job writes TensorBoard event files (read back with
tensorboard's EventAccumulator) and serves Prometheus metrics (scraped while the
job runs, parsed with prometheus_client); ``elasticdl status`` shows the same
figures live and after the end; the master never loads torch. The Local
strategy's in-process job core writes the same series."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from elasticdl.common.job_spec import job_spec_from_flags
from elasticdl.local.job import run_local_job
from elasticdl_client.job_figures import endpoint_of, scrape
from tests.conftest import MODEL_ZOO, ROOT
from tests.integration.helpers import (
    cli_env,
    kill_job_tree,
    live_replicas,
    read_json,
    start_cli,
    wait_for,
)

pytestmark = pytest.mark.integration

TRAIN_RECORDS = 1437


def scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(logdir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def check_series(s: dict[str, list[tuple[int, float]]], report: dict) -> None:
    """The series a finished training job's event files hold, against its report."""
    loss = s["train/loss"]
    assert len(loss) >= 10
    steps = [st for st, _ in loss]
    assert steps == sorted(steps) and steps[-1] > steps[0] >= 0
    values = [v for _, v in loss]
    assert all(math.isfinite(v) and 0 < v < 10 for v in values), values
    first, last = values[:3], values[-3:]
    assert sum(last) / 3 < sum(first) / 3, values  # it learns
    # the learning rates the trainers reported (a trainer that reports none: no series);
    # TensorBoard keeps float32
    lrs = sorted({float(np.float32(v)) for _, v in s.get("train/learning_rate", [])})
    report_lrs = sorted({float(np.float32(lr)) for e in report["training"]
                         for lr in e["learning_rates"]})
    assert lrs == report_lrs and all(v > 0 for v in lrs)
    # every evaluation, at the version it evaluated, with the report's values
    for name in report["evaluations"][0]["metrics"]:
        want = [(e["model_version"], e["metrics"][name]) for e in report["evaluations"]]
        got = s[f"eval/{name}"]
        assert [st for st, _ in got] == [v for v, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)
    assert s["eval/accuracy"][-1][1] > 0.8
    assert [v for _, v in s["job/epochs_completed"]] == [0, 1, 2]
    assert s["job/relaunches"][-1][1] == len(report["relaunches"])
    assert all(v > 0 for _, v in s["train/records_per_second"])


def training_tasks(spec) -> int:
    from elasticdl.common.task import TaskType
    from elasticdl.data.datasets import create_readers
    from elasticdl.master.task_state import make_tasks

    shards = create_readers(spec)[TaskType.TRAINING].create_shards()
    return len(make_tasks(shards, spec.records_per_task))


def torch_loaded(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def status(home: str, job: str) -> str:
    r = subprocess.run([sys.executable, "-m", "elasticdl_client.main", "status", job],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=cli_env(home))
    assert r.returncode == 0, r.stderr
    return r.stdout


def one(samples, name, **labels):
    return samples[name][tuple(sorted(labels.items()))]


class Scraper(threading.Thread):
    """Scrapes /metrics every 0.3 s while the job runs; keeps every scrape."""

    def __init__(self, job_dir: str):
        super().__init__(daemon=True)
        self.job_dir, self.scrapes, self.stop, self.errors = job_dir, [], threading.Event(), []

    def run(self) -> None:
        while not self.stop.is_set():
            address = endpoint_of(self.job_dir)
            if address:
                try:
                    self.scrapes.append(scrape(address))
                except OSError as e:  # the master ended between two scrapes
                    self.errors.append(str(e))
            self.stop.wait(0.3)


def test_ps_job_tensorboard_prometheus_and_status(digits_data, tmp_path):
    home, job, out = str(tmp_path / "home"), "obs-ps", str(tmp_path / "out")
    args = ["train", f"--model_zoo={MODEL_ZOO}", "--model_def=digits.digits_cnn.custom_model",
            f"--training_data={digits_data}/train", f"--validation_data={digits_data}/val",
            "--distribution_strategy=ParameterServerStrategy", "--num_workers=2",
            "--num_ps_pods=1", "--num_epochs=2", "--minibatch_size=32",
            "--evaluation_steps=20", f"--output={out}", f"--job_name={job}",
            "--cluster=local"]
    tasks_per_epoch = training_tasks(job_spec_from_flags("train", {
        "model_zoo": MODEL_ZOO, "model_def": "digits.digits_cnn.custom_model",
        "training_data": f"{digits_data}/train", "minibatch_size": 32}))
    proc = start_cli(args, home, str(tmp_path / "cli.log"))
    scraper = Scraper(out)
    try:
        master_pid = wait_for(lambda: (read_json(os.path.join(out, "master.json")) or {})
                              .get("pid"), 120, "the master")
        wait_for(lambda: endpoint_of(out), 120, "the metrics endpoint")
        scraper.start()

        def mid_training():
            s = scraper.scrapes[-1] if scraper.scrapes else None
            return s and one(s, "elasticdl_model_version") > 0 and \
                one(s, "elasticdl_tasks", type="training", state="done") > 0
        wait_for(mid_training, 300, "training under way")
        # the workers held (SIGSTOP) while `elasticdl status` starts and reads: on a loaded
        # machine the CLI's start-up outlasted the rest of training once (a CI run: the
        # job had succeeded, its endpoint gone); tasks are reassigned only after 60 s
        workers = [r["pid"] for r in live_replicas(out) if r["replica"].startswith("worker")]
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            live = status(home, job)
        finally:
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        assert not torch_loaded(master_pid)
        assert proc.wait(timeout=600) == 0, (tmp_path / "cli.log").read_text()[-3000:]
    finally:
        scraper.stop.set()
        kill_job_tree(proc, out)
    scraper.join(10)
    report = read_json(os.path.join(out, "job_report.json"))
    assert report["status"] == "succeeded"
    assert report["metrics_endpoint"] == endpoint_of(out)

    # Prometheus, scraped while the job ran
    scrapes = scraper.scrapes
    assert len(scrapes) >= 3
    versions = [one(s, "elasticdl_model_version") for s in scrapes]
    assert versions == sorted(versions) and versions[-1] > 0
    for s in scrapes:
        assert one(s, "elasticdl_epoch_records") == TRAIN_RECORDS
        assert one(s, "elasticdl_epochs") == 2
        assert one(s, "elasticdl_workers_requested") == 2
        assert 0 <= one(s, "elasticdl_workers_alive") <= 2
        assert one(s, "elasticdl_ps_requested") == 1
        for (_, done) in s.get("elasticdl_epoch_records_completed", {}).items():
            assert 0 <= done <= TRAIN_RECORDS
        tasks = s["elasticdl_tasks"]
        assert sum(v for k, v in tasks.items() if ("type", "training") in k) == \
            2 * tasks_per_epoch
        (info, value), = s["elasticdl_job_info"].items()
        assert value == 1 and dict(info) == {
            "job_name": job, "strategy": "ParameterServerStrategy", "cluster": "local",
            "job_type": "train", "status": dict(info)["status"]}
        assert dict(info)["status"] in ("running", "succeeded")
    mid = next(s for s in scrapes if one(s, "elasticdl_tasks", type="training",
                                         state="done") > 0)
    assert one(mid, "elasticdl_ps_alive") == 1
    assert 0 < one(mid, "elasticdl_training_loss") < 10
    if any(e["learning_rates"] for e in report["training"]):
        assert one(mid, "elasticdl_learning_rate") > 0
    else:  # the PS trainer reports no learning rate (yet): none is made up
        assert not mid.get("elasticdl_learning_rate")
    assert one(mid, "elasticdl_training_records_per_second") > 0
    last = scrapes[-1]
    evaluated = last.get("elasticdl_evaluation_metric", {})
    if evaluated:  # an evaluation had completed: the report's, at that version
        v = one(last, "elasticdl_evaluation_model_version")
        entry = next(e for e in report["evaluations"] if e["model_version"] == v)
        assert one(last, "elasticdl_evaluation_metric", metric="accuracy") == \
            pytest.approx(entry["metrics"]["accuracy"])

    # TensorBoard, written by the master
    check_series(scalars(os.path.join(out, "tensorboard")), report)

    # elasticdl status: live figures from the endpoint, then the report's
    assert "live from http://" in live and "master running" in live
    assert re.search(r"tasks: .*training \d+ todo/\d+ doing/\d+ done", live), live
    assert re.search(r"alive: workers \d/2, PS \d/1", live), live
    assert re.search(r"training: loss [0-9.e-]+, learning rate ([0-9.e-]+|\?), [0-9.]+ "
                     r"records/s", live), live
    ended = status(home, job)
    assert "from job_report.json" in ended
    assert f"model version {report['model_version']}" in ended
    for e in report["epochs"]:
        assert f"epoch {e['epoch']}: {TRAIN_RECORDS}/{TRAIN_RECORDS} records (100.0%)" in ended
    final = report["evaluations"][-1]
    assert f"last evaluation (model version {final['model_version']}): accuracy=" \
        f"{final['metrics']['accuracy']:.4f}" in ended
    assert f"loss {report['training'][-1]['mean_loss']:.6g} (epoch 1 mean)" in ended
    assert "relaunches: none" in ended


def test_local_job_writes_the_same_series(digits_data, tmp_path):
    spec = job_spec_from_flags("train", {
        "model_zoo": MODEL_ZOO, "model_def": "mnist.mnist_example.custom_model",
        "training_data": f"{digits_data}/train", "validation_data": f"{digits_data}/val",
        "num_epochs": 2, "minibatch_size": 32, "evaluation_steps": 20,
        "output": str(tmp_path), "job_name": "obs-local"})
    started = time.monotonic()
    report = run_local_job(spec)
    assert report["status"] == "succeeded", time.monotonic() - started
    s = scalars(os.path.join(str(tmp_path), "tensorboard"))
    check_series(s, report)
    # one loss point per training task, at the job's version after it
    assert len(s["train/loss"]) == 2 * training_tasks(spec)


def test_restarted_master_appends_to_the_series(digits_data, tmp_path):
    """kill -9 of the master after the first evaluation reached its event file (20 epochs:
    with 3 a loaded CI run once had the job all but done by then, and with 6 a CI run
    found it done, in 9.5 s, before the kill; no new endpoint came within 120 s): the
    relaunched master serves /metrics on a new port (republished) and writes a second
    event file; together they hold each evaluation once, steps never go back."""
    import signal

    home, job, out = str(tmp_path / "home"), "obs-failover", str(tmp_path / "out")
    args = ["train", f"--model_zoo={MODEL_ZOO}", "--model_def=digits.digits_cnn.custom_model",
            f"--training_data={digits_data}/train", f"--validation_data={digits_data}/val",
            "--distribution_strategy=ParameterServerStrategy", "--num_workers=2",
            "--num_ps_pods=1", "--num_epochs=20", "--minibatch_size=32",
            "--num_minibatches_per_task=1", f"--output={out}", f"--job_name={job}",
            "--cluster=local"]
    logdir = os.path.join(out, "tensorboard")
    proc = start_cli(args, home, str(tmp_path / "cli.log"))
    try:
        first = wait_for(lambda: read_json(os.path.join(out, "metrics_endpoint.json")), 120,
                         "the metrics endpoint")
        wait_for(lambda: os.path.isdir(logdir) and scalars(logdir).get("eval/accuracy"), 300,
                 "the first evaluation in the event file", interval_s=0.5)
        os.kill(first["pid"], signal.SIGKILL)
        second = wait_for(lambda: (lambda m: m if m and m["pid"] != first["pid"] else None)(
            read_json(os.path.join(out, "metrics_endpoint.json"))), 120,
            "the relaunched master's endpoint")
        # the relaunched master may serve /metrics a moment before it noted its restart
        restarted = wait_for(lambda: (lambda s: s if s.get("elasticdl_master_restarts_total")
                                      and one(s, "elasticdl_master_restarts_total") >= 1
                                      else None)(scrape(second["address"])), 60,
                             "a scrape of the relaunched master counting its restart")
        assert one(restarted, "elasticdl_master_restarts_total") == 1
        assert one(restarted, "elasticdl_epochs_completed") >= 1  # restored, not reset
        assert proc.wait(timeout=600) == 0, (tmp_path / "cli.log").read_text()[-3000:]
    finally:
        kill_job_tree(proc, out)
    report = read_json(os.path.join(out, "job_report.json"))
    assert report["status"] == "succeeded" and len(report["master_restarts"]) == 1
    assert report["metrics_endpoint"] == second["address"] != first["address"]
    files = [n for n in os.listdir(logdir) if n.startswith("events.out.tfevents.")]
    assert len(files) == 2, files
    s = scalars(logdir)
    evaluated = {e["model_version"]: e["metrics"]["accuracy"] for e in report["evaluations"]}
    got = s["eval/accuracy"]
    steps = [st for st, _ in got]
    assert len(steps) == len(set(steps)), got  # no evaluation written twice
    assert steps[0] == min(evaluated) and steps[-1] == max(evaluated)
    for step, value in got:
        assert value == pytest.approx(evaluated[step], rel=1e-6)
    loss_steps = [st for st, _ in s["train/loss"]]
    assert loss_steps == sorted(loss_steps)  # across both files: never back
    assert [v for _, v in s["job/epochs_completed"]][-1] == 20
