"""Allreduce members learn the master's closed tasks (with the training tasks it
hands out) and keep only the others in their trained-record set: the checkpoints'
trained-group.json hold the closed intervals and a handful of entries, and every
record is still trained exactly once per epoch (counted on the exported model,
tests/fixtures/zoo/toy/count_records.py).

The sets tasks carry are snapshots up to a second old, so a member can finish a
short job knowing none of them (issue 32: a fast run on an idle machine wrote a
final checkpoint with ``"closed": []``). The export order carries the master's
closed set fresh: the final checkpoint holds every task as closed whatever the
members learnt, and a resume from it trains nothing. The staleness is driven, not
waited for: ``ELASTICDL_CLOSED_MAX_AGE_S`` holds the snapshot for the whole job."""

from __future__ import annotations

import os

import pytest
import torch

from elasticdl.checkpoint import data_position
from elasticdl.checkpoint.paths import complete_versions, version_dir
from tests.conftest import FIXTURE_ZOO, ID_RECORDS
from tests.integration.helpers import kill_job_tree, read_json, start_cli

pytestmark = pytest.mark.integration

EPOCHS = 3
MINIBATCH = 8


def _train(id_data, tmp_path, name: str, *extra: str, **env: str) -> tuple[dict, dict]:
    """An allreduce count_records job; its report and exported state."""
    job_dir = str(tmp_path / name)
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.count_records.custom_model",
            f"--training_data={id_data}", f"--output={job_dir}", f"--job_name=ar-{name}",
            "--cluster=local", f"--minibatch_size={MINIBATCH}", "--num_minibatches_per_task=2",
            f"--num_epochs={EPOCHS}", "--distribution_strategy=AllreduceStrategy",
            "--num_workers=2", *extra]
    log = tmp_path / f"{name}.log"
    proc = start_cli(args, str(tmp_path / "home"), str(log), COUNT_RECORDS=str(ID_RECORDS),
                     **env)
    try:
        assert proc.wait(timeout=420) == 0, log.read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    return report, torch.load(os.path.join(job_dir, "model.pt"), weights_only=True)


def _task_ids(ckpt: str) -> set[int]:
    """The ids of every training task of the run (its task table)."""
    _base, blocks, _sources = data_position.read_table_blocks(ckpt)
    return {b.base + i for b in blocks for i in range(b.count)}


def _check_final_holds_every_task(ckpt: str) -> str:
    """The final model's checkpoint (written after training by the exporter) holds
    every task of the job as closed, and no entries: training is over."""
    final_dir = version_dir(ckpt, complete_versions(ckpt)[-1])
    final = read_json(os.path.join(final_dir, "trained-group.json"))
    closed = final["closed"]
    assert closed, "the final checkpoint lost the closed tasks"
    missing = [t for t in _task_ids(ckpt)
               if not any(closed[i] <= t < closed[i + 1] for i in range(0, len(closed), 2))]
    assert not missing, f"{len(missing)} tasks of the job not closed in the final checkpoint"
    assert final["entries"] == []
    return final_dir


def test_allreduce_trained_set_keeps_only_open_tasks(id_data, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # the snapshot refreshed at every reply: whether a member learns a closed set before
    # a periodic checkpoint must not depend on how the leases and the 1 s refresh fall
    # (a run on an idle machine leased each epoch in one or two calls and kept [])
    report, state = _train(id_data, tmp_path, "closed", "--checkpoint_steps=20",
                           f"--checkpoint_dir={ckpt}", ELASTICDL_CLOSED_MAX_AGE_S="0")
    assert [e["records_completed"] for e in report["epochs"]] == [ID_RECORDS] * EPOCHS
    for name in ("even", "odd"):
        assert torch.equal(state[name], torch.full((ID_RECORDS,), float(EPOCHS))), name
    versions = complete_versions(ckpt)
    total = ID_RECORDS * EPOCHS // MINIBATCH   # minibatches of the job
    _check_final_holds_every_task(ckpt)
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


def test_members_that_learnt_no_closed_set_still_write_a_final_checkpoint_of_every_task(
        id_data, tmp_path):
    """The snapshot tasks carry never refreshes during the job (the fast run of issue
    32, made certain): the final checkpoint still holds every task closed, and a job
    resumed from it trains nothing and changes no parameter."""
    ckpt = str(tmp_path / "ckpt")
    stale = {"ELASTICDL_CLOSED_MAX_AGE_S": "3600"}
    _report, state = _train(id_data, tmp_path, "stale", "--checkpoint_steps=20",
                            f"--checkpoint_dir={ckpt}", **stale)
    for name in ("even", "odd"):
        assert torch.equal(state[name], torch.full((ID_RECORDS,), float(EPOCHS))), name
    # what the members knew: the periodic checkpoints never learnt a closed task
    periodic = read_json(os.path.join(version_dir(ckpt, complete_versions(ckpt)[-2]),
                                      "trained-group.json"))
    assert periodic["closed"] == [] and periodic["entries"]
    final_dir = _check_final_holds_every_task(ckpt)

    resumed, again = _train(id_data, tmp_path, "resumed", f"--checkpoint_dir_for_init={final_dir}",
                            **stale)
    assert [e["records_completed"] for e in resumed["epochs"]] == [ID_RECORDS] * EPOCHS
    assert resumed["timings"]["training_records_this_run"] == 0
    assert resumed["timings"]["training_records_resumed"] == ID_RECORDS * EPOCHS
    assert resumed["model_version"] == resumed["resumed_from_version"]
    for name in ("even", "odd"):   # not one record trained again: every count unchanged
        assert torch.equal(again[name], state[name]), name
