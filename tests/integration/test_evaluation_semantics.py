"""Evaluations describe the model they evaluated, per strategy (PS sync and
async), through the CLI:
one epoch-end evaluation per epoch, the final one at the report's
``model_version``, each version evaluated once, and ``final_metrics`` equal to
what ``elasticdl evaluate --checkpoint_dir_for_init=<the job's output>``
computes on the exported ``model.pt``."""

from __future__ import annotations

import math
import os

import pytest

from tests.conftest import MODEL_ZOO
from tests.integration.helpers import kill_job_tree, read_json, start_cli

pytestmark = pytest.mark.integration

STRATEGIES = {
    "local": {"distribution_strategy": "Local"},
    "ps": {"distribution_strategy": "ParameterServerStrategy", "num_workers": 2,
           "num_ps_pods": 1, "grads_to_wait": 2},
    "ps-async": {"distribution_strategy": "ParameterServerStrategy", "num_workers": 2,
                 "num_ps_pods": 2, "use_async": "true"},
    "allreduce": {"distribution_strategy": "AllreduceStrategy", "num_workers": 2},
}


def _run(args: list[str], home: str, log: str, timeout_s: float) -> None:
    job_dir = next(a.split("=", 1)[1] for a in args if a.startswith("--output="))
    proc = start_cli(args, home, log)
    try:
        code = proc.wait(timeout=timeout_s)
    finally:
        kill_job_tree(proc, job_dir)
    with open(log, errors="replace") as f:
        tail = f.read()[-4000:]
    assert code == 0, tail


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_final_metrics_are_the_exported_models(digits_data, tmp_path, name):
    home, out, ev_out = str(tmp_path / "home"), str(tmp_path / "job"), str(tmp_path / "eval")
    common = [f"--model_zoo={MODEL_ZOO}", "--model_def=digits.digits_cnn.custom_model",
              f"--validation_data={digits_data}/val", "--cluster=local"]
    flags = {**STRATEGIES[name], "num_epochs": 2, "evaluation_steps": 10}
    _run(["train", *common, f"--training_data={digits_data}/train", f"--output={out}",
          f"--job_name=evsem-{name}", *[f"--{k}={v}" for k, v in flags.items()]],
         home, str(tmp_path / "train.log"), 420)
    report = read_json(os.path.join(out, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    evals = report["evaluations"]
    versions = [e["model_version"] for e in evals]
    assert versions == sorted(set(versions)), evals  # each version evaluated once
    assert [e["epoch"] for e in evals if "epoch_end" in e["reasons"]] == [0, 1], evals
    finals = [e for e in evals if "final" in e["reasons"]]
    assert len(finals) == 1 and finals[0] is evals[-1], evals
    assert finals[0]["model_version"] == report["model_version"] > 0, (evals, report)
    assert report["final_metrics"] == finals[0]["metrics"]
    periodic = [e for e in evals if "periodic" in e["reasons"]]
    assert periodic, evals  # evaluation_steps=10 over some 23 versions per epoch or more

    _run(["evaluate", *common, f"--checkpoint_dir_for_init={out}", f"--output={ev_out}",
          f"--job_name=evsem-{name}-eval"], home, str(tmp_path / "eval.log"), 240)
    ev = read_json(os.path.join(ev_out, "job_report.json"))
    assert ev["status"] == "succeeded", ev.get("failure")
    assert [e["model_version"] for e in ev["evaluations"]] == [report["model_version"]]
    assert ev["final_metrics"].keys() == report["final_metrics"].keys()
    for k, v in report["final_metrics"].items():
        assert math.isclose(ev["final_metrics"][k], v, rel_tol=0, abs_tol=1e-6), \
            (k, v, ev["final_metrics"][k])
