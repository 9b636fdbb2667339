"""Distributed training resumes model, optimizer and version from a checkpoint."""

from __future__ import annotations

import os

import pytest

from elasticdl.checkpoint.paths import complete_versions
from tests.integration.helpers import kill_job_tree, read_json, start_cli
from tests.integration.test_chaos import train_args

pytestmark = pytest.mark.integration


def run(args, tmp_path, job_dir):
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        assert proc.wait(timeout=300) == 0, (tmp_path / "cli.log").read_text()[-3000:]
    finally:
        kill_job_tree(proc, job_dir)
    return read_json(os.path.join(job_dir, "job_report.json"))


def test_allreduce_resumes_from_checkpoint(digits_data, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = run(train_args(digits_data, tmp_path / "a", "resume-a", num_epochs=1,
                           distribution_strategy="AllreduceStrategy", num_workers=2,
                           checkpoint_dir=ckpt, checkpoint_steps=5),
                tmp_path, str(tmp_path / "a"))
    assert first["status"] == "succeeded"
    latest = complete_versions(ckpt)[-1]
    assert latest >= 5
    second = run(train_args(digits_data, tmp_path / "b", "resume-b", num_epochs=1,
                            distribution_strategy="AllreduceStrategy", num_workers=2,
                            checkpoint_dir_for_init=ckpt),
                 tmp_path, str(tmp_path / "b"))
    assert second["status"] == "succeeded"
    assert second["epochs"][0]["records_completed"] == 1437
    # the model went on from the checkpoint's version rather than from scratch
    assert second["model_version"] >= latest + 10
    log = open(os.path.join(tmp_path / "b", "logs", "worker-0.log")).read()
    assert f"model version {latest})" in log
