"""Chaos through the real CLI (issue 10): a sync PS job (2 workers, 2 PS) where
a worker SIGKILLs itself right after a push and before its report, and later a
PS is SIGKILLed. Every epoch's ``records_applied`` equals the dataset size, and
the PS's applied-identity ledgers show every (task, minibatch) applied exactly
once, their records summing to epochs x dataset size.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter

import pytest

from elasticdl.checkpoint.paths import complete_versions
from elasticdl.worker.ps_trainer import KILL_AFTER_STEPS_ENV
from tests.integration.fault_harness import ps_recoveries
from tests.integration.helpers import kill_job_tree, read_json, start_cli, wait_for
from tests.integration.test_chaos import pid_of, records_done, train_args

pytestmark = pytest.mark.integration

RECORDS = 1437
EPOCHS = 8


def test_ps_sync_exactly_once_under_worker_and_ps_kills(digits_data, tmp_path):
    job_dir = str(tmp_path / "job")
    ckpt = str(tmp_path / "ckpt")
    # worker 1 dies right after its 8th step was applied: the end of its first task,
    # pushed but never reported
    proc = start_cli(train_args(digits_data, job_dir, "exactly-once", num_epochs=EPOCHS,
                                distribution_strategy="ParameterServerStrategy",
                                num_workers=2, num_ps_pods=2, grads_to_wait=2,
                                checkpoint_dir=ckpt, checkpoint_steps=5,
                                envs=f"{KILL_AFTER_STEPS_ENV}=1:8"),
                     str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        # replicas.json and the checkpoint directory change at once (the job report
        # only every few seconds: waiting on it let a fast job outrun the test)
        wait_for(lambda: pid_of(job_dir, "worker-2"), 240, "worker-1's self-kill and relaunch")
        wait_for(lambda: complete_versions(ckpt), 180, "a PS checkpoint")
        assert proc.poll() is None and records_done(job_dir) < RECORDS * (EPOCHS - 1), \
            "the job outran the test"
        os.kill(wait_for(lambda: pid_of(job_dir, "ps-1"), 30, "ps-1"), signal.SIGKILL)
        code = proc.wait(timeout=480)
        assert code == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    assert [e["records_completed"] for e in report["epochs"]] == [RECORDS] * EPOCHS
    assert [e["records_applied"] for e in report["epochs"]] == [RECORDS] * EPOCHS
    relaunched = {(r["replica"], r["reason"]) for r in report["relaunches"]}
    assert ("worker-1", "killed") in relaunched and ("ps-1", "killed") in relaunched
    rollbacks = ps_recoveries(report)   # the default: ps-1 restored alone
    assert len(rollbacks) == 1 and rollbacks[0]["new_version"] > rollbacks[0][
        "checkpoint_version"]
    for i in range(2):
        with open(os.path.join(job_dir, f"ps-{i}-ledger.json")) as f:
            ledger = json.load(f)
        identities = Counter((t, mb) for t, mb, _, _ in ledger["applied"])
        assert max(identities.values()) == 1, [k for k, n in identities.items() if n > 1]
        assert sum(n for _, _, n, _ in ledger["applied"]) == RECORDS * EPOCHS
        versions = [v for _, _, _, v in ledger["applied"]]
        assert versions == sorted(versions)  # one history, numbers never reused
    logs = os.path.join(job_dir, "logs")
    worker_logs = "".join(open(os.path.join(logs, n)).read() for n in os.listdir(logs)
                          if n.startswith("worker-"))
    assert "already applied" in worker_logs  # the re-issued task resumed, not redone
