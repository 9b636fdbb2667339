"""A resumed job's report covers the whole job; training ends with a checkpoint of
the final model; resuming a job that had finished changes nothing (issue 23).

* Local, killed mid-job (SIGKILL of the CLI after a checkpoint past epoch 0's
  end) and resumed: the report lists every epoch's evaluation (the earlier ones
  from the checkpoint's history), every epoch's records once, and this run's
  records per second from this run's records only.
* Local and ParameterServerStrategy, finished (PS: killed once the final
  checkpoint is written) with ``--checkpoint_steps`` not dividing the last
  version: the final version is checkpointed, and a resume trains nothing,
  exports the identical model, and succeeds with the earlier evaluations.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from elasticdl.checkpoint.paths import complete_versions, version_dir
from tests.conftest import MODEL_ZOO
from tests.integration.helpers import kill_job_tree, read_json, start_cli, wait_for

pytestmark = pytest.mark.integration

MODEL_DEF = "digits.digits_cnn.custom_model"


@pytest.fixture(scope="module")
def small_digits(digits_data, tmp_path_factory) -> str:
    """192 training records, 64 validation records."""
    out = tmp_path_factory.mktemp("resume_digits")
    for split, n in (("train", 192), ("val", 64)):
        os.makedirs(out / split)
        with np.load(os.path.join(digits_data, split, "part-0000.npz")) as z:
            np.savez(out / split / "part-0000.npz", image=z["image"][:n], label=z["label"][:n])
    return str(out)


def _args(data: str, out: str, job: str, ckpt: str, *extra: str) -> list[str]:
    return ["train", f"--model_zoo={MODEL_ZOO}", f"--model_def={MODEL_DEF}",
            f"--training_data={data}/train", f"--validation_data={data}/val",
            f"--output={out}", f"--job_name={job}", "--cluster=local",
            f"--checkpoint_dir={ckpt}", *extra]


def _run(args: list[str], tmp_path, name: str, timeout: int = 500) -> dict:
    job_dir = args[[a.split("=")[0] for a in args].index("--output")].split("=", 1)[1]
    proc = start_cli(args, str(tmp_path / f"home-{name}"), str(tmp_path / f"{name}.log"))
    try:
        assert proc.wait(timeout=timeout) == 0, (tmp_path / f"{name}.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    return read_json(os.path.join(job_dir, "job_report.json"))


def _model(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_local_finished_job_resumed_changes_nothing(small_digits, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    flags = ["--num_epochs=3", "--minibatch_size=32", "--num_minibatches_per_task=2",
             "--checkpoint_steps=7"]
    first = _run(_args(small_digits, str(tmp_path / "a"), "resume-a", ckpt, *flags), tmp_path,
                 "a")
    assert first["status"] == "succeeded"
    last = first["model_version"]
    assert last == 18 and last % 7 != 0
    assert complete_versions(ckpt) == [7, 14, 18]     # the final model is checkpointed
    again = _run(_args(small_digits, str(tmp_path / "b"), "resume-b", ckpt, *flags,
                       f"--checkpoint_dir_for_init={ckpt}"), tmp_path, "b")
    assert again["status"] == "succeeded", again.get("failure")
    assert again["model_version"] == last
    assert complete_versions(ckpt) == [7, 14, 18]
    assert _same(_model(str(tmp_path / "a" / "model.pt")), _model(str(tmp_path / "b" /
                                                                        "model.pt")))
    assert again["evaluations"] == first["evaluations"]
    assert again["final_metrics"] == first["final_metrics"]
    assert [e["records_completed"] for e in again["epochs"]] == [192] * 3
    assert again["timings"]["training_records_this_run"] == 0
    assert again["timings"]["training_records_resumed"] == 3 * 192
    assert again["timings"]["training_records_per_s"] == 0.0
    assert [t["epoch"] for t in again["training"]] == [0, 1, 2]
    assert len(again["earlier_runs"]) == 1 and again["earlier_runs"][0]["records"] == 3 * 192


def test_local_killed_job_resumed_reports_every_epoch(small_digits, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    flags = ["--num_epochs=3", "--minibatch_size=32", "--num_minibatches_per_task=1",
             "--checkpoint_steps=4"]
    out_a = str(tmp_path / "a")
    proc = start_cli(_args(small_digits, out_a, "killed-a", ckpt, *flags),
                     str(tmp_path / "home-a"), str(tmp_path / "a.log"))
    try:   # 6 versions per epoch: version 8 is past epoch 0's end and its evaluation
        wait_for(lambda: any(v >= 8 for v in complete_versions(ckpt)), 250,
                 "a checkpoint past epoch 0", interval_s=0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        kill_job_tree(proc, out_a)
    resumed_from = max(complete_versions(ckpt))
    assert resumed_from < 18, "the job finished before it was killed"
    report = _run(_args(small_digits, str(tmp_path / "b"), "killed-b", ckpt, *flags,
                        f"--checkpoint_dir_for_init={ckpt}"), tmp_path, "b")
    assert report["status"] == "succeeded", report.get("failure")
    assert [e["records_completed"] for e in report["epochs"]] == [192] * 3
    epochs = sorted(e["epoch"] for e in report["evaluations"] if "epoch_end" in e["reasons"])
    assert epochs == [0, 1, 2], report["evaluations"]
    assert report["evaluations"][0]["model_version"] == 6           # from the first run
    assert report["resumed_from_version"] == resumed_from
    assert [t["epoch"] for t in report["training"]] == [0, 1, 2]
    resumed = report["timings"]["training_records_resumed"]
    assert resumed == 32 * resumed_from
    assert report["timings"]["training_records_this_run"] == 3 * 192 - resumed
    assert len(report["earlier_runs"]) == 1


@pytest.mark.timeout(600)   # two distributed jobs (2 workers, 2 PS) on a shared machine
def test_ps_job_killed_after_its_final_checkpoint_resumes_to_the_same_model(small_digits,
                                                                             tmp_path):
    ckpt = str(tmp_path / "ckpt")
    flags = ["--num_epochs=3", "--minibatch_size=32", "--num_minibatches_per_task=2",
             "--checkpoint_steps=7", "--distribution_strategy=ParameterServerStrategy",
             "--num_workers=2", "--num_ps_pods=2", "--grads_to_wait=1"]
    out_a = str(tmp_path / "a")
    proc = start_cli(_args(small_digits, out_a, "ps-final-a", ckpt, *flags),
                     str(tmp_path / "home-a"), str(tmp_path / "a.log"))
    try:   # 18 synchronous versions; the final one is not a multiple of 7
        wait_for(lambda: 18 in complete_versions(ckpt), 400, "the final checkpoint",
                 interval_s=0.02)
        kill_job_tree(proc, out_a)      # SIGKILL everything: killed after training
    finally:
        kill_job_tree(proc, out_a)
    assert complete_versions(ckpt)[-1] == 18
    shards = {}
    for name in sorted(os.listdir(version_dir(ckpt, 18))):
        if name.startswith("ps-") and name.endswith(".pt"):
            state = torch.load(os.path.join(version_dir(ckpt, 18), name), map_location="cpu",
                               weights_only=False)
            shards.update(state.get("dense", {}))
    report = _run(_args(small_digits, str(tmp_path / "b"), "ps-final-b", ckpt, *flags,
                        f"--checkpoint_dir_for_init={ckpt}"), tmp_path, "b")
    assert report["status"] == "succeeded", report.get("failure")
    assert report["model_version"] == 18
    assert complete_versions(ckpt)[-1] == 18            # nothing trained, nothing new
    assert report["timings"]["training_records_this_run"] == 0
    assert [e["records_completed"] for e in report["epochs"]] == [192] * 3
    epochs = sorted(e["epoch"] for e in report["evaluations"] if "epoch_end" in e["reasons"])
    assert epochs == [0, 1, 2], report["evaluations"]
    exported = _model(str(tmp_path / "b" / "model.pt"))
    assert shards and all(torch.equal(exported[k], v) for k, v in shards.items()), \
        sorted(shards)
