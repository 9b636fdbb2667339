"""Allreduce members learn the master's closed tasks (with the training tasks it
hands out) and keep only the others in their trained-record set: the checkpoints'
trained-group.json hold the closed intervals and a handful of entries, and every
record is still trained exactly once per epoch (counted on the exported model,
tests/fixtures/zoo/toy/count_records.py)."""

from __future__ import annotations

import os

import pytest
import torch

from elasticdl.checkpoint.paths import complete_versions, version_dir
from tests.conftest import FIXTURE_ZOO, ID_RECORDS
from tests.integration.helpers import kill_job_tree, read_json, start_cli

pytestmark = pytest.mark.integration

EPOCHS = 3
MINIBATCH = 8


def test_allreduce_trained_set_keeps_only_open_tasks(id_data, tmp_path):
    job_dir, ckpt = str(tmp_path / "job"), str(tmp_path / "ckpt")
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.count_records.custom_model",
            f"--training_data={id_data}", f"--output={job_dir}", "--job_name=ar-closed",
            "--cluster=local", f"--minibatch_size={MINIBATCH}", "--num_minibatches_per_task=2",
            f"--num_epochs={EPOCHS}", "--checkpoint_steps=20", f"--checkpoint_dir={ckpt}",
            "--distribution_strategy=AllreduceStrategy", "--num_workers=2"]
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / "cli.log"),
                     COUNT_RECORDS=str(ID_RECORDS))
    try:
        assert proc.wait(timeout=420) == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    assert [e["records_completed"] for e in report["epochs"]] == [ID_RECORDS] * EPOCHS
    state = torch.load(os.path.join(job_dir, "model.pt"), weights_only=True)
    for name in ("even", "odd"):
        assert torch.equal(state[name], torch.full((ID_RECORDS,), float(EPOCHS))), name
    versions = complete_versions(ckpt)
    total = ID_RECORDS * EPOCHS // MINIBATCH   # minibatches of the job
    # the final model's checkpoint (written after training by the exporter) holds the
    # closed tasks as intervals too: entries alone would make a resume retrain them
    final = read_json(os.path.join(version_dir(ckpt, versions[-1]), "trained-group.json"))
    assert final["closed"], "the final checkpoint lost the closed tasks"
    # the newest periodic checkpoint before it: compact while the job runs
    late = read_json(os.path.join(version_dir(ckpt, versions[-2]), "trained-group.json"))
    closed = late["closed"]
    assert closed and sum(closed[i + 1] - closed[i] for i in range(0, len(closed), 2)) > 10
    # entries are only for tasks not closed yet: the members' leases and in-flight work,
    # whose share of this small job grows on a loaded machine (closed sets reach members
    # with their next tasks), so the bound is half the job, not a tight window
    def is_closed(task: int) -> bool:
        return any(closed[i] <= task < closed[i + 1] for i in range(0, len(closed), 2))

    assert not [e for e in late["entries"] if is_closed(e[0])], "a closed task kept entries"
    assert len(late["entries"]) < total // 2, (len(late["entries"]), total)
