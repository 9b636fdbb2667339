"""Allreduce, a member SIGKILLed mid-task: its re-queued task skips the minibatches the
group already applied, so every record is trained exactly once per epoch.

The fixture model's parameters count the optimizer steps that trained each record
(tests/fixtures/zoo/toy/count_records.py); the traced variant logs each minibatch a
worker feeds, so the test kills worker-1 while it holds a task with several of its
minibatches stepped (the feed of minibatch i of a task comes after the steps of
minibatches 0..i-1 returned)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.conftest import FIXTURE_ZOO
from tests.conftest import ID_RECORDS as RECORDS
from tests.integration.helpers import kill_job_tree, live_replicas, read_json, start_cli, wait_for

pytestmark = pytest.mark.integration

MINIBATCH = 4
PER_TASK = 16            # minibatches per task: a task lasts 16 steps of its holder
TASK = MINIBATCH * PER_TASK
EPOCHS = 2


def _pid(job_dir, replica):
    return next((r["pid"] for r in live_replicas(job_dir) if r["replica"] == replica), None)


def _mid_task(trace_dir, pid):
    """The minibatch index (in its task) worker ``pid`` last fed, once it is well into a
    task: at least 3 of the task's minibatches stepped and at least 4 left."""
    try:
        with open(os.path.join(trace_dir, f"{pid}.log")) as f:
            lines = f.read().split()
    except OSError:
        return None
    if len(lines) < PER_TASK // 2:   # past the start (group formed, steps flowing)
        return None
    index = (int(lines[-1]) % TASK) // MINIBATCH
    return index if 3 <= index <= PER_TASK - 4 else None


def test_a_member_killed_mid_task_leaves_every_record_trained_once_per_epoch(id_data,
                                                                              tmp_path):
    job_dir, trace = str(tmp_path / "job"), tmp_path / "trace"
    trace.mkdir()
    args = ["train", f"--model_zoo={FIXTURE_ZOO}",
            "--model_def=toy.count_records_traced.custom_model",
            f"--training_data={id_data}", f"--output={job_dir}", "--job_name=ar-once",
            "--cluster=local", "--distribution_strategy=AllreduceStrategy", "--num_workers=3",
            f"--minibatch_size={MINIBATCH}", f"--num_minibatches_per_task={PER_TASK}",
            f"--num_epochs={EPOCHS}", "--collective_timeout_s=20"]
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / "cli.log"),
                     COUNT_RECORDS=str(RECORDS), COUNT_RECORDS_DELAY_S="0.05",
                     COUNT_RECORDS_TRACE_DIR=str(trace))
    try:
        victim = wait_for(lambda: _pid(job_dir, "worker-1"), 120, "worker-1 started")
        index = wait_for(lambda: proc.poll() is None and _mid_task(str(trace), victim), 240,
                         "worker-1 in the middle of a task", interval_s=0.01)
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    assert [r["replica"] for r in report["relaunches"]] == ["worker-1"], report["relaunches"]
    assert [e["records_completed"] for e in report["epochs"]] == [RECORDS] * EPOCHS
    state = torch.load(os.path.join(job_dir, "model.pt"), weights_only=True)
    for name in ("even", "odd"):
        counts = state[name]
        wrong = (counts != EPOCHS).nonzero().flatten().tolist()
        assert not wrong, (f"killed at minibatch {index} of a task; {name}: records "
                           f"trained != {EPOCHS} times: "
                           f"{[(i, counts[i].item()) for i in wrong[:20]]} ({len(wrong)} in all)")
    # the kill landed mid-task: the task's next holder skipped what was applied
    logs = os.path.join(job_dir, "logs")
    skipped = [n for n in os.listdir(logs)
               if "already in the model" in open(os.path.join(logs, n)).read()]
    assert skipped, f"no worker resumed a task (killed at minibatch {index})"
