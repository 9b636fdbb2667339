"""Global evaluation metrics are exact: the AUC a 3-worker job reports (each
worker evaluating some of the validation set's tasks, the master merging their
metric states through a finalize task) equals scikit-learn's ``roc_auc_score``
on the whole validation set, computed from the exported model's outputs, on a
model whose scores have many ties. Through the CLI with ``--cluster=local``
(PS and allreduce), and in process (Local)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from elasticdl.common.job_spec import job_spec_from_flags
from elasticdl.local.job import run_local_job
from tests.conftest import FIXTURE_ZOO
from tests.fixtures.zoo.toy import tied_scores
from tests.integration.helpers import kill_job_tree, read_json, start_cli

pytestmark = pytest.mark.integration
sklearn_metrics = pytest.importorskip("sklearn.metrics")

VAL_RECORDS = 700
FLAGS = {"model_zoo": FIXTURE_ZOO, "model_def": "toy.tied_scores.custom_model",
         "minibatch_size": 32, "num_minibatches_per_task": 2,  # 11 validation tasks
         "eval_minibatch_size": 50, "num_epochs": 1}
STRATEGIES = {
    "ps": {"distribution_strategy": "ParameterServerStrategy", "num_workers": 3,
           "num_ps_pods": 1, "use_async": "true"},
    "allreduce": {"distribution_strategy": "AllreduceStrategy", "num_workers": 3},
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tied")
    tied_scores.write_data(str(out / "train"), 640, seed=1)
    tied_scores.write_data(str(out / "val"), VAL_RECORDS, seed=2)
    return str(out)


def _exported_scores(out: str, data: str) -> tuple[np.ndarray, np.ndarray]:
    model = tied_scores.TiedScores()
    model.load_state_dict(torch.load(os.path.join(out, "model.pt"), weights_only=True))
    model.eval()
    with np.load(os.path.join(data, "val", "data.npz")) as f:
        x, y = f["x"], f["y"]
    with torch.no_grad():
        scores = model(torch.from_numpy(x)).numpy()
    return y, scores


def _check(report: dict, out: str, data: str) -> None:
    assert report["status"] == "succeeded", report.get("failure")
    assert report["dataset"]["validation_records"] == VAL_RECORDS
    y, scores = _exported_scores(out, data)
    distinct = len(np.unique(scores))
    assert 3 <= distinct <= 21 < VAL_RECORDS, distinct  # many ties, yet scores differ
    want = sklearn_metrics.roc_auc_score(y, scores)
    final = report["final_metrics"]
    assert abs(final["auc"] - want) <= 1e-6, (final, want)
    assert abs(final["accuracy"] - float(np.mean((scores >= 0.5) == (y == 1)))) <= 1e-9
    # what the old per-minibatch mean gives is not the global AUC
    assert abs(final["batch_auc"] - want) > 1e-4, (final, want)
    evals = report["evaluations"]
    assert evals[-1]["metrics"] == final and evals[-1]["model_version"] > 0


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_global_auc_of_three_workers_equals_sklearn(data, tmp_path, name):
    home, out = str(tmp_path / "home"), str(tmp_path / "job")
    flags = {**FLAGS, **STRATEGIES[name], "training_data": f"{data}/train",
             "validation_data": f"{data}/val", "cluster": "local", "output": out,
             "job_name": f"gmetrics-{name}"}
    log = str(tmp_path / "train.log")
    evals_dir = tmp_path / "evaluated"
    evals_dir.mkdir()
    proc = start_cli(["train", *[f"--{k}={v}" for k, v in flags.items()]], home, log,
                     TIED_EVAL_DELAY_S="0.1", TIED_EVAL_LOG_DIR=str(evals_dir))
    try:
        code = proc.wait(timeout=420)
    finally:
        kill_job_tree(proc, out)
    with open(log, errors="replace") as f:
        assert code == 0, f.read()[-4000:]
    report = read_json(os.path.join(out, "job_report.json"))
    assert report is not None
    _check(report, out, data)
    # the evaluations' records were spread over several worker processes
    per_process = {p.name: sum(int(n) for n in p.read_text().split())
                   for p in evals_dir.iterdir()}
    assert len(per_process) >= 2, per_process
    assert sum(per_process.values()) >= VAL_RECORDS * len(report["evaluations"]), per_process


def test_global_auc_local_strategy_equals_sklearn(data, tmp_path):
    out = str(tmp_path / "job")
    spec = job_spec_from_flags("train", {**FLAGS, "training_data": f"{data}/train",
                                         "validation_data": f"{data}/val", "output": out,
                                         "job_name": "gmetrics-local"})
    _check(run_local_job(spec), out, data)
