"""``elasticdl scale`` on running local jobs (issue 22): a job started at
``--num_workers=1:2`` is scaled up to 3 workers and then down to 1 mid-epoch,
in PS async, PS sync (``--grads_to_wait=3``) and allreduce. The record-counting
model (tests/fixtures/zoo/toy/count_records.py) shows every record trained
exactly once per epoch; the retired workers are stopped, not relaunched, and the
job report records both resizes and the worker-count timeline."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import FIXTURE_ZOO
from tests.conftest import ID_RECORDS as RECORDS
from tests.integration.helpers import (
    ROOT,
    cli_env,
    kill_job_tree,
    live_replicas,
    read_json,
    start_cli,
    wait_for,
)

pytestmark = pytest.mark.integration

EPOCHS = 3
MINIBATCH = 4
PER_TASK = 8

STRATEGIES = {
    "ps-async": ["--distribution_strategy=ParameterServerStrategy", "--use_async=true",
                 "--num_ps_pods=2"],
    "ps-sync": ["--distribution_strategy=ParameterServerStrategy", "--grads_to_wait=3",
                "--sync_version_tolerance=2", "--num_ps_pods=2"],
    "allreduce": ["--distribution_strategy=AllreduceStrategy", "--collective_timeout_s=20"],
}


def _workers(job_dir):
    return sorted(r["replica"] for r in live_replicas(job_dir) if r["replica"].startswith("w"))


def _scale(home, job, n):
    out = subprocess.run([sys.executable, "-m", "elasticdl_client.main", "scale", job,
                          f"--num_workers={n}"], cwd=ROOT, env=cli_env(home),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _trained(trace_dir):
    """Minibatches fed so far (all workers), from the traced model's logs."""
    total = 0
    for name in os.listdir(trace_dir):
        with open(os.path.join(trace_dir, name)) as f:
            total += len(f.read().split())
    return total


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_scale_up_and_down_mid_epoch_trains_every_record_once(id_data, tmp_path, strategy):
    job, job_dir, home = f"scale-{strategy}", str(tmp_path / "job"), str(tmp_path / "home")
    trace = tmp_path / "trace"
    trace.mkdir()
    args = ["train", f"--model_zoo={FIXTURE_ZOO}",
            "--model_def=toy.count_records_traced.custom_model",
            f"--training_data={id_data}", f"--output={job_dir}", f"--job_name={job}",
            "--cluster=local", "--num_workers=1:2", f"--minibatch_size={MINIBATCH}",
            f"--num_minibatches_per_task={PER_TASK}", f"--num_epochs={EPOCHS}",
            *STRATEGIES[strategy]]
    steps = RECORDS // MINIBATCH * EPOCHS
    proc = start_cli(args, home, str(tmp_path / "cli.log"), COUNT_RECORDS=str(RECORDS),
                     COUNT_RECORDS_DELAY_S="0.1", COUNT_RECORDS_TRACE_DIR=str(trace))
    try:
        wait_for(lambda: _trained(str(trace)) >= steps // 8, 240, "training under way")
        assert "MIN:MAX 3:3" in _scale(home, job, "3")
        wait_for(lambda: len(_workers(job_dir)) == 3, 120, "a third worker")
        wait_for(lambda: _trained(str(trace)) >= steps // 3, 240, "more training")
        assert proc.poll() is None, "the job outran the test"
        assert "MIN:MAX 1:1" in _scale(home, job, "1")
        wait_for(lambda: len(_workers(job_dir)) == 1, 240, "two workers retired")
        assert proc.wait(timeout=480) == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    assert [e["records_completed"] for e in report["epochs"]] == [RECORDS] * EPOCHS
    assert report["relaunches"] == [], report["relaunches"]   # retired: not replaced
    w = report["workers"]
    assert [(r["from"], r["to"]) for r in w["resizes"]] == [("1:2", "3:3"), ("3:3", "1:1")]
    assert max(p[1] for p in w["timeline"]) == 3
    assert w["preempted"] == 0
    state = torch.load(os.path.join(job_dir, "model.pt"), weights_only=True)
    for name in ("even", "odd"):
        counts = state[name]
        wrong = (counts != EPOCHS).nonzero().flatten().tolist()
        assert not wrong, (f"{strategy}: {name}: records trained != {EPOCHS} times: "
                           f"{[(i, counts[i].item()) for i in wrong[:20]]} ({len(wrong)})")
