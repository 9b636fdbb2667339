"""The demo's claim: the Local strategy reaches >= 0.95 validation accuracy on digits."""

import pytest

from elasticdl.common.job_spec import job_spec_from_flags
from elasticdl.local.job import run_local_job
from tests.conftest import MODEL_ZOO

pytestmark = pytest.mark.integration


def test_digits_local_reaches_095(digits_data, tmp_path):
    spec = job_spec_from_flags("train", {
        "model_zoo": MODEL_ZOO, "model_def": "digits.digits_cnn.custom_model",
        "training_data": f"{digits_data}/train", "validation_data": f"{digits_data}/val",
        "num_epochs": 5, "output": str(tmp_path), "job_name": "digits-test"})
    report = run_local_job(spec)
    assert report["status"] == "succeeded"
    assert [e["records_completed"] for e in report["epochs"]] == [1437] * 5
    assert report["final_metrics"]["accuracy"] >= 0.95, report["evaluations"]
