"""Training health in a distributed job (issue 28): an async ParameterServerStrategy
job (2 workers, 1 PS) whose loss rises far above its best (``toy.diverge``: SGD
above its stability limit, deterministic, no NaN) ends ``succeeded_with_warnings``
(``--on_divergence=warn``: the CLI exits 0 and prints the warning), every record
counted, the evidence in ``training_health``; with ``--on_divergence=fail`` the job
fails naming the verdict; with ``rollback`` (``toy.diverge_late``) every PS goes back to a
checkpoint before the divergence, the rate is cut, and the job trains healthy.

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


def _run(tmp_path, job_dir: str, args: list[str], **env: str) -> tuple[int, str, dict]:
    """The CLI job to its end: (exit code, CLI log, job report)."""
    log = tmp_path / "cli.log"
    proc = start_cli(args, str(tmp_path / "home"), str(log), **env)
    try:
        code = proc.wait(timeout=800)
    finally:
        kill_job_tree(proc, job_dir)
    text = log.read_text()
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report is not None, text[-4000:]
    return code, text, report


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
    code, text, report = _run(tmp_path, job_dir, args)
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


def test_a_diverging_ps_job_rolls_back_cuts_the_rate_and_trains_healthy(tmp_path):
    """``--on_divergence=rollback`` (``toy.diverge_late``: stable SGD until a step
    schedule lifts the rate past the stability limit): the master rolls every PS back to
    the newest checkpoint at or before the best loss, sets aside the checkpoints the
    diverged model wrote, and halves the rate; the job then trains healthy and ends
    ``succeeded_with_warnings``, every record counted once per epoch, and its exported
    model fits the data (a diverged one is off by orders of magnitude)."""
    import numpy as np
    import torch

    # toy.linear's records, with noise: the loss floor is the noise's variance (0.01),
    # not 1e-14, so a divergence shows within a few updates of the rate's lift
    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32) + 0.1 +
         rng.normal(scale=0.1, size=320)).astype(np.float32)
    os.makedirs(tmp_path / "train")
    for i, part in enumerate((slice(0, 160), slice(160, 320))):
        np.savez(tmp_path / "train" / f"part-{i}.npz", x=x[part], y=y[part],
                 id=np.arange(320, dtype=np.int64)[part])
    job_dir, ckpt = str(tmp_path / "job"), tmp_path / "ckpt"
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.diverge_late.custom_model",
            f"--training_data={tmp_path / 'train'}", f"--output={job_dir}", "--cluster=local",
            "--job_name=diverge-rollback", "--num_epochs=6", "--minibatch_size=16",
            "--num_minibatches_per_task=2", "--distribution_strategy=ParameterServerStrategy",
            # one worker: two would push gradients a version stale, and stale SGD at
            # lr 0.6 is still unstable here (e' = e - 1.2 e_prev: |z| = sqrt(1.2)), so
            # the number of rollbacks would depend on timing
            "--num_workers=1", "--num_ps_pods=2",
            "--health_window_tasks=2", "--on_divergence=rollback",
            f"--checkpoint_dir={ckpt}", "--checkpoint_steps=5"]
    code, text, report = _run(tmp_path, job_dir, args, TOY_DIVERGE_AFTER="20")
    health = report["training_health"]
    assert code == 0, text[-4000:]
    assert report["status"] == "succeeded_with_warnings", (report["status"], health)
    lines = [line for line in text.splitlines() if "diverged" in line or "rolled" in line]
    assert health["status"] == "healthy" and health["restarts"] == 1, (health, lines)
    assert "rolled back 1 time(s)" in text
    assert [e["records_completed"] for e in report["epochs"]] == [320] * 6
    # the diverged model's checkpoints were set aside; what is left resumes the job
    aside = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("diverged-version-"))
    assert aside, sorted(p.name for p in ckpt.iterdir())
    # the exported model fits the data: its MSE near the noise's variance (0.01; SGD at
    # lr 0.6 on minibatches of 16 keeps some of its own); a diverged model's weights
    # are off by orders of magnitude
    state = torch.load(os.path.join(job_dir, "model.pt"), weights_only=True)
    pred = x @ state["fc.weight"].reshape(-1).numpy() + float(state["fc.bias"])
    mse = float(np.mean((pred - y) ** 2))
    assert mse < 0.1, (mse, state)
