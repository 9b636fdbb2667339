"""The Local strategy end to end in one process (tiny linear model)."""

import os

import pytest
import torch

from elasticdl.checkpoint import single as ckpt
from elasticdl.common.job_report import read_report
from elasticdl.common.job_spec import job_spec_from_flags
from elasticdl.data.api import MalformedRecordError
from elasticdl.local.job import run_local_job
from elasticdl.worker.prediction import read_predictions
from tests.conftest import FIXTURE_ZOO


@pytest.fixture
def toy(tmp_path):
    import sys

    sys.path.insert(0, FIXTURE_ZOO)
    from toy import linear

    linear.write_data(str(tmp_path / "train"), n=300)
    linear.write_data(str(tmp_path / "val"), n=100, seed=1)
    linear.reset()
    return linear, tmp_path


def spec(tmp_path, job_type="train", **flags):
    base = {"model_zoo": FIXTURE_ZOO, "model_def": "toy.linear.custom_model",
            "training_data": str(tmp_path / "train"), "validation_data": str(tmp_path / "val"),
            "minibatch_size": 16, "num_minibatches_per_task": 4, "output": str(tmp_path / "out"),
            "job_name": "toy"}
    return job_spec_from_flags(job_type, {**base, **flags})


def test_trains_evaluates_exports_and_reports(toy):
    linear, tmp = toy
    report = run_local_job(spec(tmp, num_epochs=3, evaluation_steps=10,
                                export_torchscript=True))
    assert report["status"] == "succeeded"
    assert [e["records_completed"] for e in report["epochs"]] == [300, 300, 300]
    assert sorted(linear.TRAINED) == sorted(list(range(300)) * 3)
    versions = [e["model_version"] for e in report["evaluations"]]
    assert 10 in versions and versions[-1] == report["model_version"] == 3 * 20
    assert report["final_metrics"]["mse"] < report["evaluations"][0]["metrics"]["mse"]
    assert read_report(str(tmp / "out")) ["status"] == "succeeded"
    state = torch.load(tmp / "out" / "model.pt", weights_only=True)
    model = linear.custom_model()
    model.load_state_dict(state)
    scripted = torch.jit.load(str(tmp / "out" / "model_scripted.pt"))
    x = torch.randn(3, 4)
    assert torch.allclose(scripted(x), model(x))


def test_resume_continues_from_saved_data_position(toy):
    linear, tmp = toy
    ckdir = str(tmp / "ckpt")
    # 300 records, 16 per batch, 64 per task: checkpoint at version 6 falls mid-task
    linear.reset(stop_after_batches=8)
    with pytest.raises(KeyboardInterrupt):
        run_local_job(spec(tmp, checkpoint_dir=ckdir, checkpoint_steps=3))
    assert ckpt.complete_versions(ckdir) == [3, 6]
    trained_before_ckpt = list(linear.TRAINED[:6 * 16])
    assert read_report(str(tmp / "out"))["status"] == "failed"
    linear.reset()
    report = run_local_job(spec(tmp, checkpoint_dir_for_init=ckdir))
    resumed = list(linear.TRAINED)
    assert not set(trained_before_ckpt) & set(resumed), "records trained twice in the epoch"
    assert sorted(trained_before_ckpt + resumed) == list(range(300))
    assert report["epochs"][0]["records_completed"] == 300
    assert report["model_version"] == 20  # 2 files x (4 + 4 + 2) minibatches: 6 + 14


def test_keep_checkpoint_max(toy):
    _, tmp = toy
    ckdir = str(tmp / "ckpt")
    run_local_job(spec(tmp, checkpoint_dir=ckdir, checkpoint_steps=2, keep_checkpoint_max=2))
    assert ckpt.complete_versions(ckdir) == [18, 20]


def test_evaluate_and_predict_from_checkpoint(toy):
    linear, tmp = toy
    ckdir = str(tmp / "ckpt")
    run_local_job(spec(tmp, checkpoint_dir=ckdir, checkpoint_steps=100, num_epochs=2))
    ev = run_local_job(spec(tmp, "evaluate", checkpoint_dir_for_init=ckdir,
                            output=str(tmp / "ev")))
    assert ev["status"] == "succeeded" and ev["evaluations"][0]["model_version"] == 40
    assert ev["final_metrics"]["mse"] >= 0
    pred = run_local_job(spec(tmp, "predict", checkpoint_dir_for_init=ckdir,
                              prediction_data=str(tmp / "val"), output=str(tmp / "pred")))
    assert pred["records_predicted"] == 100
    outputs = read_predictions(str(tmp / "pred"))
    pairs = sorted((os.path.basename(src), int(i)) for src, idx, _ in outputs for i in idx)
    assert len(pairs) == len(set(pairs)) == 100
    assert all(o.shape == (len(idx),) for _, idx, o in outputs)


def test_malformed_record_names_file_and_record(toy):
    _, tmp = toy
    csv_dir = tmp / "csv"
    csv_dir.mkdir()
    rows = [f"{i},{i},{i},{i},{i},{i}" for i in range(100)]
    rows[70] = "1,2,oops,4,5,70"
    (csv_dir / "part-0.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(MalformedRecordError) as e:
        run_local_job(spec(tmp, training_data=str(csv_dir)))
    assert e.value.record_index == 70 and e.value.path.endswith("part-0.csv")
    assert "oops" in str(e.value)
    report = read_report(str(tmp / "out"))
    assert report["status"] == "failed"
    assert "part-0.csv" in report["failure"]["error"] and "70" in report["failure"]["error"]


@pytest.fixture
def nan_toy(toy, monkeypatch):
    import importlib

    monkeypatch.setenv("TOY_NAN_FROM_ID", "200")
    linear, tmp = toy

    def load(mode):
        monkeypatch.setenv("TOY_NAN_MODE", mode)
        from toy import nan

        return importlib.reload(nan)
    return load, tmp


@pytest.mark.parametrize("mode,named", [("loss", "non-finite loss (nan)"),
                                        ("grad", "non-finite gradient of parameter 'fc.bias'")])
def test_nonfinite_step_fails_job_naming_it_and_model_stays_finite(nan_toy, mode, named):
    """Issue 11: a NaN loss/gradient used to train on and report `succeeded`."""
    from elasticdl.local.job import TaskFailedError

    load, tmp = nan_toy
    load(mode)
    with pytest.raises(TaskFailedError, match="failed 2 time"):
        run_local_job(spec(tmp, model_def="toy.nan.custom_model", max_task_retries=2))
    report = read_report(str(tmp / "out"))
    assert report["status"] == "failed"
    error = report["failure"]["error"]
    assert named in error and "at step" in error and "(task" in error
    assert not (tmp / "out" / "model.pt").exists()


def test_skip_nonfinite_steps_counts_and_exports_a_finite_model(nan_toy):
    load, tmp = nan_toy
    load("loss")
    report = run_local_job(spec(tmp, model_def="toy.nan.custom_model",
                                skip_nonfinite_steps=True))
    assert report["status"] == "succeeded"
    # ids 200..299 poison every minibatch they fall in: 16-record batches over 2 files
    assert report["nonfinite_steps_skipped"] >= 100 // 16
    state = torch.load(tmp / "out" / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state.values())


def test_evaluate_from_a_jobs_output_reproduces_its_final_metrics(toy):
    """``--checkpoint_dir_for_init=<a job's --output>``: its exported model.pt (a
    plain state dict) is what the final evaluation evaluated."""
    _, tmp = toy
    report = run_local_job(spec(tmp, num_epochs=2, evaluation_steps=7))
    evals = report["evaluations"]
    assert [e["epoch"] for e in evals if "epoch_end" in e["reasons"]] == [0, 1]
    assert evals[-1]["reasons"] == ["epoch_end", "final"]
    assert evals[-1]["model_version"] == report["model_version"] == 40
    ev = run_local_job(spec(tmp, "evaluate", checkpoint_dir_for_init=str(tmp / "out"),
                            output=str(tmp / "ev")))
    assert [e["model_version"] for e in ev["evaluations"]] == [40]
    assert ev["final_metrics"]["mse"] == pytest.approx(report["final_metrics"]["mse"],
                                                       abs=1e-6, rel=0)
