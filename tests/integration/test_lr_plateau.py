"""ReduceLROnPlateau lowers the rate after a plateau in every strategy, and the
rate survives a master kill (issue 23).

The module (tests/fixtures/zoo/toy/digits_plateau.py) monitors the validation
accuracy with ``mode="max", threshold_mode="abs", threshold=1.0, patience=0,
factor=0.5``: every evaluation after the first is a plateau. Each job is a real
CLI job; the expected rate of every epoch is what torch's own ReduceLROnPlateau
gives when stepped with the report's evaluations, in order: the rate each epoch
was trained with (reported by whoever holds the optimizer: this process, each PS
shard, each allreduce member) must be exactly that, and it must have gone down.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.conftest import FIXTURE_ZOO, MODEL_ZOO
from tests.integration.helpers import (
    kill_job_tree,
    read_json,
    start_cli,
    task_events,
    wait_for,
)

pytestmark = pytest.mark.integration

MODEL_DEF = "toy.digits_plateau.custom_model"

def _base_lr() -> float:
    import sys

    sys.path.insert(0, MODEL_ZOO)
    from digits.digits_cnn import LEARNING_RATE  # its Adam's rate

    return float(LEARNING_RATE)


BASE_LR = _base_lr()
STRATEGIES = {
    "Local": ["--distribution_strategy=Local"],
    "PS": ["--distribution_strategy=ParameterServerStrategy", "--num_workers=2",
           "--num_ps_pods=2", "--grads_to_wait=1"],
    "Allreduce": ["--distribution_strategy=AllreduceStrategy", "--num_workers=2"],
}


@pytest.fixture(scope="module")
def small_digits(digits_data, tmp_path_factory) -> str:
    """192 training records, 64 validation records."""
    out = tmp_path_factory.mktemp("plateau_digits")
    for split, n in (("train", 192), ("val", 64)):
        os.makedirs(out / split)
        with np.load(os.path.join(digits_data, split, "part-0000.npz")) as z:
            np.savez(out / split / "part-0000.npz", image=z["image"][:n], label=z["label"][:n])
    return str(out)


def epoch_lrs(entry: dict) -> list[float]:
    """The distinct rates a report's ``training`` entry saw (a list, or the bounded
    summary {first, last, min, max, count})."""
    seen = entry.get("learning_rates")
    if isinstance(seen, dict):
        return sorted({seen["first"], seen["last"], seen["min"], seen["max"]})
    return sorted(set(seen or []))


def expected_lrs(report: dict, epochs: int) -> tuple[list[float], int]:
    """Torch's ReduceLROnPlateau stepped with the report's evaluations: the rate of
    each epoch (after the evaluations of the epochs before it) and the reductions."""
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=BASE_LR)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(
        opt, mode="max", factor=0.5, patience=0, threshold=1.0, threshold_mode="abs")
    evals = sorted(report["evaluations"], key=lambda e: e["model_version"])
    out, reductions, i = [], 0, 0
    for epoch in range(epochs):
        while i < len(evals) and evals[i].get("epoch") is not None and \
                evals[i]["epoch"] < epoch:
            before = opt.param_groups[0]["lr"]
            sched.step(evals[i]["metrics"]["accuracy"])
            reductions += opt.param_groups[0]["lr"] < before
            i += 1
        out.append(opt.param_groups[0]["lr"])
    for e in evals[i:]:   # evaluations after the last epoch's training (final)
        before = opt.param_groups[0]["lr"]
        sched.step(e["metrics"]["accuracy"])
        reductions += opt.param_groups[0]["lr"] < before
    return out, reductions


def check_plateau_report(report: dict, epochs: int, records: int) -> None:
    assert report["status"] == "succeeded", report.get("failure")
    assert [e["records_completed"] for e in report["epochs"]] == [records] * epochs
    expected, reductions = expected_lrs(report, epochs)
    seen = {t["epoch"]: epoch_lrs(t) for t in report["training"]}
    assert seen == {e: [pytest.approx(expected[e], rel=1e-6)] for e in range(epochs)}, \
        (seen, expected, report["evaluations"])
    assert expected[-1] < expected[0]      # the plateau did lower the rate
    summary = report["lr_schedule"]
    assert summary["monitor"] == "accuracy" and summary["reductions"] == reductions
    assert summary["evaluations"] == len(report["evaluations"])


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_plateau_lowers_the_rate(strategy, small_digits, tmp_path):
    epochs = 3
    job_dir = str(tmp_path / "job")
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", f"--model_def={MODEL_DEF}",
            f"--training_data={small_digits}/train", f"--validation_data={small_digits}/val",
            f"--output={job_dir}", "--cluster=local", f"--job_name=plateau-{strategy.lower()}",
            f"--num_epochs={epochs}", "--minibatch_size=32", "--num_minibatches_per_task=2",
            *STRATEGIES[strategy]]
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        assert proc.wait(timeout=400) == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    check_plateau_report(report, epochs, 192)


def _training_of_epoch_out(job_dir: str, epoch: int) -> bool:
    """A training task of ``epoch`` went out: the evaluation that ended the epoch
    before it completed (the epoch barrier) and its reduction was decided."""
    return any(r["op"] == "get" and r["task"][1] == 1 and r["task"][5] >= epoch
               for r in task_events(job_dir))


def test_plateau_rate_survives_a_master_kill(digits_data, tmp_path):
    epochs = 4
    job_dir = str(tmp_path / "job")
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", f"--model_def={MODEL_DEF}",
            f"--training_data={digits_data}/train", f"--validation_data={digits_data}/val",
            f"--output={job_dir}", "--cluster=local", "--job_name=plateau-failover",
            f"--num_epochs={epochs}", "--minibatch_size=32", "--num_minibatches_per_task=1",
            "--distribution_strategy=ParameterServerStrategy", "--num_workers=2",
            "--num_ps_pods=1"]
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        # epoch 2 trains after the evaluation of epoch 1 (a plateau): the rate was lowered
        wait_for(lambda: _training_of_epoch_out(job_dir, 2), 300,
                 "epoch 2's training (after the first reduction)", interval_s=0.05)
        pid = int(read_json(os.path.join(job_dir, "master.json"))["pid"])
        os.kill(pid, 9)
        code = proc.wait(timeout=600)
        assert code == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert len(report["master_restarts"]) == 1, report["master_restarts"]
    check_plateau_report(report, epochs, 1437)
