"""Training health in a distributed job (issue 28): an async ParameterServerStrategy
job (2 workers, 1 PS) whose loss rises far above its best (``toy.diverge``: SGD
above its stability limit, deterministic, no NaN) ends ``succeeded_with_warnings``
(``--on_divergence=warn``: the CLI exits 0 and prints the warning), every record
counted, the evidence in ``training_health``; with ``--on_divergence=fail`` the job
fails naming the verdict.

The async digits-CNN divergence of docs/limits.md is not reproduced here: it
happened in 1 of 4 and 1 of 12 runs, too rare and slow for a test; the detector's
decision on that loss shape (a spike, then ln 10 for good) is
``tests/unit/master/test_training_health.py::test_a_loss_flat_at_its_initial_value_is_stalled``."""

from __future__ import annotations

import os
import sys

import pytest

from tests.conftest import FIXTURE_ZOO
from tests.integration.helpers import kill_job_tree, read_json, start_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.mark.parametrize("mode", ["warn", "fail"])
def test_async_ps_job_that_diverges_is_marked(tmp_path, mode):
    sys.path.insert(0, FIXTURE_ZOO)
    from toy import linear

    linear.write_data(str(tmp_path / "train"), n=300)
    job_dir = str(tmp_path / "job")
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.diverge.custom_model",
            f"--training_data={tmp_path / 'train'}", f"--output={job_dir}", "--cluster=local",
            f"--job_name=diverge-{mode}", "--num_epochs=3", "--minibatch_size=16",
            "--num_minibatches_per_task=2", "--distribution_strategy=ParameterServerStrategy",
            "--use_async=true", "--num_workers=2", "--num_ps_pods=1",
            "--health_window_tasks=2", f"--on_divergence={mode}"]
    log = tmp_path / "cli.log"
    proc = start_cli(args, str(tmp_path / "home"), str(log))
    try:
        code = proc.wait(timeout=800)
    finally:
        kill_job_tree(proc, job_dir)
    text = log.read_text()
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report is not None, text[-4000:]
    health = report["training_health"]
    assert health["status"] == "diverged", (health, text[-3000:])
    assert health["window_means"][-1] > 10 * health["best"]
    if mode == "warn":
        assert code == 0, text[-4000:]
        assert report["status"] == "succeeded_with_warnings"
        assert "succeeded with warnings: training diverged" in text
        assert [e["records_completed"] for e in report["epochs"]] == [300] * 3
    else:
        assert code != 0 and report["status"] == "failed"
        assert "training diverged" in report["failure"]["error"], report["failure"]
