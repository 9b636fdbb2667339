"""Training health in a Local job (issue 28): a job whose loss rises far above its
best (``toy.diverge``: SGD above its stability limit) ends
``succeeded_with_warnings`` with the evidence under ``training_health``
(``--on_divergence=warn``, the default), ``failed`` naming the verdict with
``--on_divergence=fail``; a healthy job ends a plain ``succeeded`` with
``training_health.status == "healthy"``."""

import pytest

from elasticdl.local.job import run_local_job
from tests.unit.local.test_local_job import spec, toy  # noqa: F401 - the fixture


@pytest.mark.parametrize("mode", ["warn", "fail"])
def test_a_diverging_job_is_marked_never_a_plain_success(toy, mode):  # noqa: F811
    _, tmp = toy
    report = run_local_job(spec(tmp, model_def="toy.diverge.custom_model", num_epochs=3,
                                health_window_tasks=1, on_divergence=mode))
    health = report["training_health"]
    assert health["status"] == "diverged", health
    assert "rose above the best" in health["reason"]
    means = health["window_means"]
    assert means[-1] > 10 * health["best"] and health["thresholds"]["patience"] == 2
    if mode == "warn":
        assert report["status"] == "succeeded_with_warnings"
        assert [e["records_completed"] for e in report["epochs"]] == [300] * 3
    else:
        assert report["status"] == "failed"
        assert "training diverged" in report["failure"]["error"]


def test_a_healthy_job_ends_plain_succeeded(toy):  # noqa: F811
    _, tmp = toy
    report = run_local_job(spec(tmp, num_epochs=3, health_window_tasks=1))
    assert report["status"] == "succeeded"
    assert report["training_health"]["status"] == "healthy"
    assert report["training_health"]["windows"] == 18   # 2 files of 150: 3 tasks each, 3 epochs


def test_off_leaves_no_health_in_the_report(toy):  # noqa: F811
    _, tmp = toy
    report = run_local_job(spec(tmp, model_def="toy.diverge.custom_model",
                                on_divergence="off", health_window_tasks=1))
    assert report["status"] == "succeeded" and "training_health" not in report
