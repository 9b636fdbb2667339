"""Master + worker processes on 127.0.0.1: distributed predict that survives a
SIGKILLed worker, and a corrupt record that fails the job fast."""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import pytest

from elasticdl.worker.prediction import read_predictions
from tests.conftest import FIXTURE_ZOO
from tests.integration.helpers import kill_job_tree, live_replicas, read_json, start_cli, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def toy_checkpoint(tmp_path):
    sys.path.insert(0, FIXTURE_ZOO)
    from toy import linear

    from elasticdl.common.job_spec import job_spec_from_flags
    from elasticdl.local.job import run_local_job

    linear.write_data(str(tmp_path / "train"), n=200)
    linear.write_data(str(tmp_path / "predict"), n=6000, files=3, seed=5)
    spec = job_spec_from_flags("train", {
        "model_zoo": FIXTURE_ZOO, "model_def": "toy.linear.custom_model",
        "training_data": str(tmp_path / "train"), "output": str(tmp_path / "trained"),
        "checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_steps": 1000,
        "job_name": "toy-train"})
    run_local_job(spec)
    return tmp_path


def predict_args(tmp, job, data, **flags):
    args = ["predict", f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.linear.custom_model",
            f"--prediction_data={data}", f"--checkpoint_dir_for_init={tmp / 'ckpt'}",
            f"--output={tmp / job}", f"--job_name={job}", "--num_workers=3",
            "--cluster=local"]
    return args + [f"--{k}={v}" for k, v in flags.items()]


def test_predict_survives_sigkill_of_a_worker(toy_checkpoint):
    tmp = toy_checkpoint
    job_dir = str(tmp / "pred")
    proc = start_cli(predict_args(tmp, "pred", tmp / "predict", minibatch_size=50,
                                  num_minibatches_per_task=4, envs="TOY_FEED_DELAY_S=0.1"),
                     str(tmp / "home"), str(tmp / "cli.log"))
    try:
        pred_dir = os.path.join(job_dir, "predictions")
        wait_for(lambda: os.path.isdir(pred_dir) and len(os.listdir(pred_dir)) >= 3, 120,
                 "first predictions")
        log = os.path.join(job_dir, "logs", "worker-1.log")
        wait_for(lambda: "first task" in open(log).read(), 120, "worker-1 working")
        time.sleep(0.2)  # well inside a task (each takes 4 x 0.1 s)
        victim = next(r for r in live_replicas(job_dir) if r["replica"] == "worker-1")
        os.kill(victim["pid"], signal.SIGKILL)
        assert proc.wait(timeout=180) == 0, (tmp / "cli.log").read_text()[-3000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded"
    assert report["prediction"]["records_completed"] == 6000
    assert report["prediction"]["records_redone"] > 0
    assert report["relaunches"][0]["replica"] == "worker-1"
    assert report["relaunches"][0]["new_replica"] == "worker-3"
    assert report["relaunches"][0]["exit_code"] == -signal.SIGKILL
    outputs = read_predictions(job_dir)
    seen = [(os.path.basename(src), int(i)) for src, idx, _ in outputs for i in idx]
    assert len(seen) == 6000 and len(set(seen)) == 6000
    # outputs join back to inputs: compare with the model applied to the input rows
    import torch
    from toy import linear

    model = linear.custom_model()
    model.load_state_dict(torch.load(tmp / "trained" / "model.pt", weights_only=True))
    src, idx, out = outputs[0]
    with np.load(src) as z:
        expected = model(torch.from_numpy(z["x"][idx])).detach().numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_corrupt_record_fails_job_fast_naming_it(toy_checkpoint):
    tmp = toy_checkpoint
    bad = tmp / "bad"
    bad.mkdir()
    rows = [f"{i},{i},{i},{i},{i},{i}" for i in range(600)]
    rows[421] = "1,2,not-a-number,4,5,421"
    (bad / "part-0.csv").write_text("\n".join(rows) + "\n")
    job_dir = str(tmp / "badjob")
    start = time.monotonic()
    proc = start_cli(predict_args(tmp, "badjob", bad, minibatch_size=50),
                     str(tmp / "home"), str(tmp / "cli.log"))
    try:
        code = proc.wait(timeout=120)
    finally:
        kill_job_tree(proc, job_dir)
    elapsed = time.monotonic() - start
    log = (tmp / "cli.log").read_text()
    assert code == 1, log[-3000:]
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "failed"
    error = report["failure"]["error"]
    assert "part-0.csv" in error and "record 421" in error, error
    assert "not-a-number" in error
    assert elapsed < 60, f"took {elapsed:.0f} s to fail"
