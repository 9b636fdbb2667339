"""The PS ledger stays O(live) in a real job (docs/scale.md): the master's settle
thread tells both PS which tasks are closed, checkpoints are written compacted,
a PS is SIGKILLed and every PS rolls back to a compacted checkpoint; every record
is still applied exactly once per epoch, counted on the exported parameters
(tests/fixtures/zoo/toy/count_records.py), and the PS's final ledgers hold a
handful of live pushes while their on-disk audit trail has every one."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter

import pytest
import torch

from elasticdl.checkpoint.paths import complete_versions, version_dir
from tests.conftest import FIXTURE_ZOO, ID_RECORDS
from tests.integration.fault_harness import ps_recoveries
from tests.integration.helpers import kill_job_tree, read_json, start_cli, wait_for
from tests.integration.test_chaos import pid_of

pytestmark = pytest.mark.integration

EPOCHS = 4
MINIBATCH = 8


def _compacted_version(ckpt: str) -> int:
    """A complete checkpoint version whose trained-ps files of both PS have a closed
    set (the settle reached both before they saved), or 0."""
    for v in reversed(complete_versions(ckpt)):
        vdir = version_dir(ckpt, v)
        closed = []
        for i in range(2):
            path = os.path.join(vdir, f"trained-ps-{i}-of-2.json")
            closed.append(bool(os.path.exists(path) and read_json(path).get("closed")))
        if all(closed):
            return v
    return 0


def test_ps_job_settles_ledgers_and_rolls_back_to_a_compacted_checkpoint(id_data, tmp_path):
    job_dir, ckpt = str(tmp_path / "job"), str(tmp_path / "ckpt")
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.count_records.custom_model",
            f"--training_data={id_data}", f"--output={job_dir}", "--job_name=settle",
            "--cluster=local", f"--minibatch_size={MINIBATCH}", "--num_minibatches_per_task=4",
            f"--num_epochs={EPOCHS}", "--checkpoint_steps=5", f"--checkpoint_dir={ckpt}",
            "--distribution_strategy=ParameterServerStrategy", "--num_workers=2",
            "--num_ps_pods=2", "--shuffle"]
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / "cli.log"),
                     COUNT_RECORDS=str(ID_RECORDS), COUNT_RECORDS_DELAY_S="0.1")
    try:
        version = wait_for(lambda: _compacted_version(ckpt), 240, "a compacted checkpoint",
                           interval_s=0.2)
        assert proc.poll() is None, (tmp_path / "cli.log").read_text()[-3000:]
        os.kill(wait_for(lambda: pid_of(job_dir, "ps-1"), 30, "ps-1"), signal.SIGKILL)
        assert proc.wait(timeout=420) == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    assert [e["records_completed"] for e in report["epochs"]] == [ID_RECORDS] * EPOCHS
    assert [e["records_applied"] for e in report["epochs"]] == [ID_RECORDS] * EPOCHS
    rollbacks = ps_recoveries(report)   # the default: ps-1 restored alone
    assert len(rollbacks) == 1 and rollbacks[0]["checkpoint_version"] >= version
    rolled_to = version_dir(ckpt, rollbacks[0]["checkpoint_version"])
    assert all(read_json(os.path.join(rolled_to, f"trained-ps-{i}-of-2.json"))["closed"]
               for i in range(2))   # the rollback restored compacted ledgers
    state = torch.load(os.path.join(job_dir, "model.pt"), weights_only=True)
    for name in ("even", "odd"):   # every record applied exactly once per epoch
        wrong = (state[name] != EPOCHS).nonzero().flatten().tolist()
        assert not wrong, (name, [(i, state[name][i].item()) for i in wrong[:20]])
    pushes = ID_RECORDS * EPOCHS // MINIBATCH
    for i in range(2):
        with open(os.path.join(job_dir, f"ps-{i}-ledger.json")) as f:
            ledger = json.load(f)
        identities = Counter((t, mb) for t, mb, _, _ in ledger["applied"])
        assert max(identities.values()) == 1
        assert sum(n for _, _, n, _ in ledger["applied"]) == ID_RECORDS * EPOCHS
        assert ledger["closed"] and ledger["live_pushes"] < pushes // 4, \
            (ledger["live_pushes"], pushes)
