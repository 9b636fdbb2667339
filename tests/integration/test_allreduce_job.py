"""Chaos test of AllreduceStrategy through the real CLI, master and process cluster:
3 workers on digits, kill -9 one mid-training; the other two go on in their
processes, the relaunched worker rejoins, records count exactly once per epoch."""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import MODEL_ZOO
from tests.integration.helpers import (
    kill_job_tree,
    live_replicas,
    read_json,
    start_cli,
    wait_for,
)

pytestmark = pytest.mark.integration


def _log(job_dir: str, replica: str) -> str:
    try:
        with open(os.path.join(job_dir, "logs", f"{replica}.log"), errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def test_allreduce_survives_kill_of_a_worker(digits_data, tmp_path):
    job, job_dir = "ar-chaos", str(tmp_path / "ar-chaos")
    args = ["train", f"--model_zoo={MODEL_ZOO}", "--model_def=digits.digits_cnn.custom_model",
            f"--training_data={os.path.join(digits_data, 'train')}",
            f"--validation_data={os.path.join(digits_data, 'val')}",
            "--distribution_strategy=AllreduceStrategy", "--num_workers=3",
            "--num_epochs=12", "--collective_timeout_s=10", f"--output={job_dir}",
            f"--job_name={job}", "--cluster=local"]
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        wait_for(lambda: all("forming plan" in _log(job_dir, f"worker-{i}") for i in range(3)),
                 90, "3 workers in a group")
        # mid-epoch: once the group has stepped a little
        wait_for(lambda: "epoch 1 done" in _log(job_dir, "master"), 60, "an epoch done")
        victim = next(r for r in live_replicas(job_dir) if r["replica"] == "worker-1")
        survivors = {r["replica"]: r["pid"] for r in live_replicas(job_dir)
                     if r["replica"] in ("worker-0", "worker-2")}
        os.kill(victim["pid"], signal.SIGKILL)
        assert proc.wait(timeout=120) == 0, open(tmp_path / "cli.log").read()[-3000:]
    finally:
        kill_job_tree(proc, job_dir)

    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report is not None and report["status"] == "succeeded", report
    assert [e["records_completed"] for e in report["epochs"]] == [1437] * 12
    assert sum(e["records_redone"] for e in report["epochs"]) > 0
    assert [(r["replica"], r["reason"]) for r in report["relaunches"]] == \
        [("worker-1", "killed")]
    new = report["relaunches"][0]["new_replica"]
    assert report["final_metrics"]["accuracy"] >= 0.95, report["final_metrics"]
    exited = {r["replica"]: r for r in
              (read_json(os.path.join(job_dir, "replicas.json")) or {}).get("exited", [])}
    for name, pid in survivors.items():  # the same processes went on and finished
        assert exited[name]["pid"] == pid and exited[name]["exit_code"] == 0
        log = _log(job_dir, name)
        assert log.count(f"start {name}") == 1
        assert "retrying the round" in log or "completed on a member" in log
    assert "broadcast to 3 member(s)" in _log(job_dir, new)  # joined and got the state
