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


def test_autoscale_grows_while_workers_pay_and_gives_back_the_one_that_does_not(tmp_path):
    """``--num_workers=1:3 --autoscale=0.5`` on a job whose throughput saturates at about
    1.9 workers (a lock every worker's minibatches share, toy/count_bottleneck.py: 0.09 s
    alone, 0.11 s locked per minibatch, so the lock saturates at 9 minibatches/s while one
    worker makes 4-5): the job starts with 1 worker, the 2nd raises throughput by ~0.9 of
    a worker's and stays, the 3rd adds at most ~0.25 and is given back (retired, its task
    returned). Every record is still trained exactly once per epoch."""
    import numpy as np

    records, epochs = 2048, 3
    data = tmp_path / "ids"
    data.mkdir()
    np.save(data / "ids.npy", np.arange(records, dtype=np.int64))
    job, job_dir = "autoscale", str(tmp_path / "job")
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.count_bottleneck.custom_model",
            f"--training_data={data}", f"--output={job_dir}", f"--job_name={job}",
            "--cluster=local", "--num_workers=1:3", "--autoscale=0.5",
            "--autoscale_window_s=6", "--minibatch_size=8", "--num_minibatches_per_task=4",
            f"--num_epochs={epochs}", *STRATEGIES["ps-async"]]
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / "cli.log"),
                     COUNT_RECORDS=str(records), COUNT_RECORDS_DELAY_S="0.09",
                     COUNT_BOTTLENECK_S="0.11", COUNT_BOTTLENECK_LOCK=str(tmp_path / "lock"))
    try:
        assert proc.wait(timeout=480) == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    assert [e["records_completed"] for e in report["epochs"]] == [records] * epochs
    w = report["workers"]
    sizes = [(r["to"], r["reason"]) for r in w["resizes"]]
    # the 3rd worker tried once the 2nd paid, then given back; on a loaded machine a
    # window may measure the 2nd worker short and give it back before trying again
    # (a loaded suite run: 42.4 records/s at 1, +14.4 from the 2nd; later 37.1 at 1,
    # 74.3 at 2): the trials before the 3rd may repeat, the outcome may not
    tos = [to for to, _ in sizes]
    assert "1:3" in tos, sizes
    k = tos.index("1:3")
    assert "trying 3" in sizes[k][1] and any("trying 2" in r for _, r in sizes[:k]), sizes
    assert k + 1 < len(sizes) and sizes[k + 1][0] == "1:2" and "given back" in sizes[k + 1][1], \
        sizes
    assert w["autoscale"]["rates"].keys() >= {"1", "2"}, w["autoscale"]
    assert w["max"] == 3 and max(p[1] for p in w["timeline"]) == 3
    assert report["relaunches"] == [], report["relaunches"]   # given back: not replaced
    state = torch.load(os.path.join(job_dir, "model.pt"), weights_only=True)
    for name in ("even", "odd"):
        wrong = (state[name][:records] != epochs).nonzero().flatten().tolist()
        assert not wrong, (name, wrong[:20], len(wrong))
