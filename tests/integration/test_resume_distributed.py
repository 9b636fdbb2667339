"""Training resumes model, optimizer, version and data position from a checkpoint."""

from __future__ import annotations

import os

import pytest
import torch

from elasticdl.checkpoint import data_position, ps_shards
from elasticdl.checkpoint.paths import complete_versions, version_dir
from tests.conftest import FIXTURE_ZOO, ID_RECORDS
from tests.integration.helpers import kill_job_tree, read_json, start_cli, wait_for
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
    # the newest checkpoint before the final model's (training ends with a checkpoint of
    # the final model, from which a resume trains nothing: test_resume_whole_job.py)
    assert complete_versions(ckpt)[-1] == first["model_version"]
    latest = [v for v in complete_versions(ckpt) if v < first["model_version"]][-1]
    assert latest >= 5
    second = run(train_args(digits_data, tmp_path / "b", "resume-b", num_epochs=1,
                            distribution_strategy="AllreduceStrategy", num_workers=2,
                            checkpoint_dir_for_init=version_dir(ckpt, latest)),
                 tmp_path, str(tmp_path / "b"))
    assert second["status"] == "succeeded"
    assert second["epochs"][0]["records_completed"] == 1437
    # the model went on from the checkpoint's version rather than from scratch, and
    # only the records not in that checkpoint were trained (it used to retrain the
    # whole epoch: ">= latest + 10" encoded that the data position was lost)
    assert latest < second["model_version"] < latest + 10
    log = open(os.path.join(tmp_path / "b", "logs", "worker-0.log")).read()
    assert f"model version {latest})" in log


# ---------------------------------------------------------------------------
# Interrupted mid-epoch and resumed: every record trained exactly once per epoch.
# The fixture model's parameters count the optimizer steps that trained each record
# (tests/fixtures/zoo/toy/count_records.py), so the exported model.pt itself says how
# often each record was trained.

RECORDS = ID_RECORDS
MINIBATCH = 8
EPOCHS = 2


def count_args(data, out, job, **flags):
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.count_records.custom_model",
            f"--training_data={data}", f"--output={out}", f"--job_name={job}",
            "--cluster=local", f"--minibatch_size={MINIBATCH}", "--num_minibatches_per_task=4",
            f"--num_epochs={EPOCHS}", "--checkpoint_steps=5", "--shuffle"]
    return args + [f"--{k}={v}" for k, v in flags.items()]


def interrupt_and_resume(tmp_path, data, strategy_flags, versions_per_epoch,
                         resume_flags=None):
    """Run a job, kill -9 its whole tree once a checkpoint mid-way through the second
    epoch exists, resume it from that checkpoint; returns (report, model state, the
    version resumed from)."""
    ckpt1, ckpt2 = str(tmp_path / "ckpt1"), str(tmp_path / "ckpt2")
    job1, job2 = str(tmp_path / "run1"), str(tmp_path / "run2")
    home = str(tmp_path / "home")
    env = {"COUNT_RECORDS": str(RECORDS), "COUNT_RECORDS_DELAY_S": "0.05"}
    threshold = versions_per_epoch + versions_per_epoch // 3
    proc = start_cli(count_args(data, job1, "count-a", checkpoint_dir=ckpt1,
                                **strategy_flags), home, str(tmp_path / "run1.log"), **env)
    try:
        # the checkpoint directory, not job_report.json (which lags): kill right after
        # a checkpoint of the second epoch is complete, well before the job ends
        wait_for(lambda: proc.poll() is not None or
                 any(v >= threshold for v in complete_versions(ckpt1)), 300,
                 "a checkpoint in the second epoch", interval_s=0.05)
        assert proc.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
    finally:
        kill_job_tree(proc, job1)
    resumed_from = complete_versions(ckpt1)[-1]
    # mid-way through the second epoch (the first one is all in the checkpoint)
    assert threshold <= resumed_from < EPOCHS * versions_per_epoch - 5, resumed_from
    first = read_json(os.path.join(job1, "job_report.json")) or {}
    assert first.get("status") != "succeeded"
    check_position_is_the_model(ckpt1, resumed_from)

    env["COUNT_RECORDS_DELAY_S"] = "0"
    proc = start_cli(count_args(data, job2, "count-b", checkpoint_dir=ckpt2,
                                checkpoint_dir_for_init=ckpt1,
                                **(resume_flags or strategy_flags)),
                     home, str(tmp_path / "run2.log"), **env)
    try:
        assert proc.wait(timeout=300) == 0, (tmp_path / "run2.log").read_text()[-3000:]
    finally:
        kill_job_tree(proc, job2)
    report = read_json(os.path.join(job2, "job_report.json"))
    state = torch.load(os.path.join(job2, "model.pt"), weights_only=True)
    return report, state, resumed_from


def expected_counts(position):
    """Per record: the epochs created less the pending ranges on it."""
    expected = torch.full((RECORDS,), float(position["epochs_created"]))
    for shard_range in position["pending"]:
        expected[shard_range[1]:shard_range[2]] -= 1
    return expected


def check_position_is_the_model(ckpt, version):
    """The data position a checkpoint records is what its model was trained on: each
    record's count in the checkpointed model == epochs created - pending ranges on it.

    Several PS need not hold the same pushes at one version (each PS writes the
    version when its own count of pushes reaches it). So for a PS checkpoint the
    exact check is per PS: the counts each PS holds are its own ledger's position.
    The position of the whole checkpoint never counts a record no PS trained
    (progress is never lost): it is at most each PS's counts."""
    vdir = version_dir(ckpt, version)
    position = data_position.read_position(vdir)
    assert position is not None, os.listdir(vdir)
    expected = expected_counts(position)
    if os.path.exists(os.path.join(vdir, "model.pt")):
        model = torch.load(os.path.join(vdir, "model.pt"), weights_only=True)["model"]
        for name in ("even", "odd"):
            assert torch.equal(model[name], expected), (
                name, (model[name] != expected).nonzero().flatten().tolist()[:20])
    else:
        trained = data_position.read_trained_set(vdir)
        base, blocks, sources = data_position.read_table_blocks(ckpt)
        writers = {name: (closed, entries) for name, closed, entries in trained.writers}
        _, num_ps = ps_shards.shard_count(vdir)
        held = set()
        for ps_id in range(num_ps):
            closed, entries = writers[f"ps-{ps_id}-of-{num_ps}"]
            own = expected_counts(data_position.position(
                base, blocks, data_position.TrainedSet(closed, entries), sources))
            dense = ps_shards.load_shard(vdir, ps_id, num_ps)["dense"]
            for name, counts in dense.items():
                held.add(name)
                assert torch.equal(counts, own), (
                    ps_id, name, (counts != own).nonzero().flatten().tolist()[:20])
                assert bool((expected <= counts).all()), (
                    ps_id, name, (expected > counts).nonzero().flatten().tolist()[:20])
        assert held == {"even", "odd"}, held
    assert 0 < len(position["pending"])   # mid-epoch: something was left


def check_exactly_once(report, state, resumed_from):
    assert report["status"] == "succeeded", report.get("failure")
    for name in ("even", "odd"):
        counts = state[name]
        wrong = (counts != EPOCHS).nonzero().flatten().tolist()
        assert not wrong, (f"{name}: records trained != {EPOCHS} times: "
                           f"{[(i, counts[i].item()) for i in wrong[:20]]} "
                           f"({len(wrong)} in all)")
    assert [e["records_completed"] for e in report["epochs"]] == [RECORDS] * EPOCHS
    # the model version went on from the checkpoint
    assert report["model_version"] > resumed_from


def test_local_resumes_mid_epoch_exactly_once(id_data, tmp_path):
    check_exactly_once(*interrupt_and_resume(
        tmp_path, id_data, {"distribution_strategy": "Local"}, RECORDS // MINIBATCH))


def test_ps_resumes_mid_epoch_exactly_once(id_data, tmp_path):
    check_exactly_once(*interrupt_and_resume(
        tmp_path, id_data, {"distribution_strategy": "ParameterServerStrategy",
                            "num_workers": 2, "num_ps_pods": 2}, RECORDS // MINIBATCH))


def test_allreduce_resumes_mid_epoch_exactly_once(id_data, tmp_path):
    check_exactly_once(*interrupt_and_resume(
        tmp_path, id_data, {"distribution_strategy": "AllreduceStrategy", "num_workers": 2},
        RECORDS // MINIBATCH // 2))


def test_a_local_checkpoint_resumes_as_allreduce_exactly_once(id_data, tmp_path):
    """The data position is one format: a Local job's checkpoint resumes a 2-worker
    allreduce job (its master reads data_position.json without torch)."""
    check_exactly_once(*interrupt_and_resume(
        tmp_path, id_data, {"distribution_strategy": "Local"}, RECORDS // MINIBATCH,
        resume_flags={"distribution_strategy": "AllreduceStrategy", "num_workers": 2}))
