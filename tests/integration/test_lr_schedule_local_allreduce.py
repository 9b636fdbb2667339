"""The pytorch/examples MNIST recipe (Adadelta, StepLR gamma 0.7 per epoch; the learning
rate per epoch in every strategy is tests/integration/test_lr_schedule.py): a resumed Local
job continues the schedule; a custom ``train_loop`` runs under
Local; a ``train_loop`` module under ParameterServerStrategy fails before any replica
starts (issue 15, items 1 and 4)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from elasticdl.checkpoint.paths import complete_versions, version_dir
from elasticdl.common.job_spec import job_spec_from_flags
from elasticdl.local.job import run_local_job
from tests.conftest import MODEL_ZOO
from tests.integration.helpers import kill_job_tree, live_replicas, read_json, start_cli

pytestmark = pytest.mark.integration

EPOCHS = 3
EXPECTED = [[1.0 * 0.7 ** e] for e in range(EPOCHS)]


@pytest.fixture(scope="module")
def small_digits(digits_data, tmp_path_factory) -> str:
    """192 training records in 2 files, 64 validation records (fast on 2 cores)."""
    out = tmp_path_factory.mktemp("small_digits")
    for split, n in (("train", 96), ("val", 64)):
        os.makedirs(out / split)
        src = np.load(os.path.join(digits_data, split, "part-0000.npz"))
        parts = 2 if split == "train" else 1
        for i in range(parts):
            sl = slice(i * n, (i + 1) * n)
            np.savez(out / split / f"part-{i:04d}.npz", image=src["image"][sl],
                     label=src["label"][sl])
    return str(out)


def _flags(data: str, out: str, **extra) -> dict:
    flags = {"model_zoo": MODEL_ZOO, "model_def": "mnist.mnist_example.custom_model",
             "training_data": f"{data}/train", "validation_data": f"{data}/val",
             "num_epochs": EPOCHS, "minibatch_size": 32, "num_minibatches_per_task": 2,
             "output": out, "job_name": "lr-test"}
    flags.update(extra)
    return flags


def _lrs(report: dict) -> list:
    return [e["learning_rates"] for e in report["training"]]




def test_resumed_local_job_continues_the_schedule(small_digits, tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    first = run_local_job(job_spec_from_flags("train", _flags(
        small_digits, str(tmp_path / "a"), checkpoint_dir=ckpt_dir, checkpoint_steps=4,
        keep_checkpoint_max=0)))
    assert _lrs(first) == EXPECTED
    # 6 steps per epoch: version 8 is inside epoch 1, after the schedule stepped once
    mid = version_dir(ckpt_dir, 8)
    assert 8 in complete_versions(ckpt_dir)
    state = torch.load(os.path.join(mid, "model.pt"), weights_only=False)
    assert state["extras"]["epoch"] == 1
    resumed = run_local_job(job_spec_from_flags("train", _flags(
        small_digits, str(tmp_path / "b"), checkpoint_dir_for_init=mid)))
    assert resumed["status"] == "succeeded"
    # the resumed job reports the whole job (job_history.json): epoch 0 as the first run
    # trained it, epochs 1 and 2 at the rates the schedule continues with
    by_epoch = {e["epoch"]: e["learning_rates"] for e in resumed["training"]}
    assert by_epoch == {0: EXPECTED[0], 1: EXPECTED[1], 2: EXPECTED[2]}


def test_custom_train_loop_runs_under_local_and_exports(small_digits, tmp_path):
    report = run_local_job(job_spec_from_flags("train", _flags(
        small_digits, str(tmp_path), model_def="mnist.mnist_custom_loop.custom_model",
        num_epochs=2)))
    assert report["status"] == "succeeded"
    assert [e["records_completed"] for e in report["epochs"]] == [192, 192]
    assert report["model_version"] == 12                 # 6 steps per epoch, 2 epochs
    exported = torch.load(os.path.join(str(tmp_path), "model.pt"), weights_only=False)
    from mnist.mnist_cnn import CNN  # noqa: E402 - the zoo is on sys.path now

    model = CNN()
    model.load_state_dict(exported)          # the trained model, exported
    assert report["training"][0]["mean_loss"] > report["training"][1]["mean_loss"]




def test_train_loop_under_ps_fails_before_any_replica_starts(small_digits, tmp_path):
    job_dir = str(tmp_path / "job")
    args = ["train"] + [f"--{k}={v}" for k, v in _flags(
        small_digits, job_dir, model_def="mnist.mnist_custom_loop.custom_model").items()] + [
        "--cluster=local", "--distribution_strategy=ParameterServerStrategy",
        "--num_workers=2", "--num_ps_pods=1"]
    started = time.monotonic()
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        code = proc.wait(timeout=120)
    finally:
        kill_job_tree(proc, job_dir)
    log = (tmp_path / "cli.log").read_text()
    assert code == 2, log[-3000:]
    assert "mnist_custom_loop.py defines train_loop(ctx)" in log
    assert "Local or AllreduceStrategy" in log
    assert time.monotonic() - started < 60
    assert live_replicas(job_dir) == []
    assert read_json(os.path.join(job_dir, "master.json")) is None
