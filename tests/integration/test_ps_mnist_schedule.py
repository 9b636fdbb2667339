"""The pytorch/examples MNIST recipe (Adadelta + StepLR(gamma=0.7) per epoch)
through the real CLI on ParameterServerStrategy (2 workers, 2 PS processes):
the scheduler runs on the PS, steps at the master's epochs, is never undone,
and every step of epoch ``e`` was applied with exactly ``0.7**e``."""

from __future__ import annotations

import os

import pytest

from tests.integration.helpers import kill_job_tree, read_json, start_cli
from tests.integration.test_chaos import train_args

pytestmark = pytest.mark.integration

EPOCHS = 3


def test_mnist_recipe_on_ps_applies_steplr_per_epoch(digits_data, tmp_path):
    job_dir = str(tmp_path / "job")
    args = train_args(digits_data, job_dir, "mnist-ps", num_epochs=EPOCHS,
                      distribution_strategy="ParameterServerStrategy", num_workers=2,
                      num_ps_pods=2, grads_to_wait=2, minibatch_size=64)
    args = [a if not a.startswith("--model_def=") else
            "--model_def=mnist.mnist_example.custom_model" for a in args]
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        code = proc.wait(timeout=540)
        assert code == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    assert [e["records_completed"] for e in report["epochs"]] == [1437] * EPOCHS
    training = report["training"]
    assert [t["epoch"] for t in training] == list(range(EPOCHS))
    for e in range(EPOCHS):
        assert training[e]["learning_rates"] == [1.0 * 0.7 ** e], training
    logs = os.path.join(job_dir, "logs")
    for i in range(2):  # each PS stepped its own scheduler at the epoch boundaries
        text = open(os.path.join(logs, f"ps-{i}.log")).read()
        assert "epoch 2, learning rate [0.48999" in text, text[-2000:]
