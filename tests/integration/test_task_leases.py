"""Task leases through the real CLI: async PS jobs of one-minibatch tasks whose
workers lease many tasks per call (``--task_lease_s=30``: up to 16, a fair
share) and send results with their next call. A worker SIGKILLs itself while it
holds a lease (tasks done but not reported, tasks not started); the master is
SIGKILLed while leases are out. Every epoch's ``records_completed`` and
``records_applied`` equal the dataset size and the PS's applied-identity ledger
shows every (task, minibatch) applied exactly once, its records summing to
epochs x dataset size.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections import Counter

import pytest

from elasticdl.worker.ps_trainer import KILL_AFTER_STEPS_ENV
from tests.integration.helpers import (
    kill_job_tree,
    read_json,
    start_cli,
    task_events,
    wait_for,
)
from tests.integration.test_chaos import pid_of, train_args

pytestmark = pytest.mark.integration

RECORDS = 1437
EPOCHS = 3
FLAGS = dict(num_epochs=EPOCHS, distribution_strategy="ParameterServerStrategy",
             use_async="true", num_workers=2, num_ps_pods=1, minibatch_size=32,
             num_minibatches_per_task=1, task_lease_s=30)


def check_exactly_once(job_dir: str) -> dict:
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    assert [e["records_completed"] for e in report["epochs"]] == [RECORDS] * EPOCHS
    assert [e["records_applied"] for e in report["epochs"]] == [RECORDS] * EPOCHS
    with open(os.path.join(job_dir, "ps-0-ledger.json")) as f:
        ledger = json.load(f)
    identities = Counter((t, mb) for t, mb, _, _ in ledger["applied"])
    assert max(identities.values()) == 1, [k for k, n in identities.items() if n > 1]
    assert sum(n for _, _, n, _ in ledger["applied"]) == RECORDS * EPOCHS
    return report


def logs_of(job_dir: str, prefix: str) -> str:
    logs = os.path.join(job_dir, "logs")
    return "".join(open(os.path.join(logs, n)).read() for n in sorted(os.listdir(logs))
                   if n.startswith(prefix))


def test_worker_killed_holding_a_lease_every_record_applied_once(digits_data, tmp_path):
    job_dir = str(tmp_path / "job")
    # worker 1 dies right after its 40th step was applied: in the middle of a lease,
    # its last results unsent and tasks of the lease not started
    proc = start_cli(train_args(digits_data, job_dir, "lease-kill",
                                envs=f"{KILL_AFTER_STEPS_ENV}=1:40", **FLAGS),
                     str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        code = proc.wait(timeout=600)
        assert code == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = check_exactly_once(job_dir)
    assert ("worker-1", "killed") in {(r["replica"], r["reason"]) for r in report["relaunches"]}
    master_log = logs_of(job_dir, "master")
    lost = [int(n) for n in re.findall(r"worker 1 lost (\d+) task\(s\)", master_log)]
    assert lost and max(lost) >= 2, lost   # a lease, not one task, was re-queued
    # the worker leased: several hand-outs per call (get records between its reports)
    assert "already applied" in logs_of(job_dir, "worker-")  # pushed, unreported: resumed


def test_master_killed_while_leases_are_out(digits_data, tmp_path):
    job_dir = str(tmp_path / "job")
    proc = start_cli(train_args(digits_data, job_dir, "lease-failover", **FLAGS),
                     str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        wait_for(lambda: pid_of(job_dir, "worker-1") and pid_of(job_dir, "worker-0"), 120,
                 "2 workers")

        def leases_out() -> bool:   # both workers hold several tasks of epoch 1 or later
            got: dict[int, set[int]] = {}
            reported: set[int] = set()
            for r in task_events(job_dir):
                if r["op"] == "get" and r["task"][1] == 1 and r["task"][5] >= 1:
                    got.setdefault(r["w"], set()).add(r["task"][0])
                elif r["op"] == "report":
                    reported.add(r["task"])
            held = [len(ids - reported) for ids in got.values()]
            return len(held) == 2 and min(held) >= 3

        wait_for(leases_out, 300, "leases out in epoch 1", interval_s=0.05)
        master = read_json(os.path.join(job_dir, "master.json"))["pid"]
        os.kill(int(master), signal.SIGKILL)
        code = proc.wait(timeout=600)
        assert code == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = check_exactly_once(job_dir)
    assert report["relaunches"] == []            # the workers kept their leases
    assert len(report["master_restarts"]) == 1
