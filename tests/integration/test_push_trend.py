"""Issue 20's end-to-end check on a small run: a push-bound async PS job through the CLI
(benchmarks/push_trend.py), a worker killed in epoch 1 and the PS in epoch 2; every
epoch's records_completed and records_applied are the dataset size, and the PS's
bookkeeping stays sized by the live work, not by the pushes it has applied.

What made the old job slow down was a ledger of every push, scanned per push. Its
effect, the pace, is a wall-clock ratio of epochs that last a few seconds here, and a
loaded CI machine moved it to 0.27 on code that holds 0.93 on the benchmark's 1e5
pushes: the pace is the benchmark's figure (README), not this test's. What this test
checks is load-independent: every checkpoint the job wrote (thousands of pushes in)
holds a ledger of the pushes since the master's last settle (every 2 s) and those out,
a fraction of its history, and a closed set of a few intervals.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from elasticdl.checkpoint.paths import complete_versions, version_dir
from elasticdl.checkpoint.ps_shards import shard_path
from tests.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def test_push_bound_ps_job_applies_every_record_once_with_a_ledger_sized_by_live_work(
        tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import push_trend
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    # ~45 s of training: the kills wait on the job report (written every few s), and a
    # 12,000-record job (18 s at 2,600 records/s) could end before ps-0 was killed
    records, epochs = 30_000, 4
    out = push_trend.run(records, epochs, str(tmp_path), kills=True, checkpoint_steps=200,
                         timeout_s=600)
    assert [k.split()[0] for k in out["killed"]] == ["worker-1", "ps-0"], out["killed"]
    assert ("ps-0", "ps-0") in [tuple(r) for r in out["relaunches"]], out["relaunches"]
    for e in out["per_epoch"]:
        assert e["records_completed"] == records == e["records_applied"], out["per_epoch"]
    assert out["exact"]
    # every push of the job reached the PS (plus those a rollback undid and made again)
    pushes = out["pushes_per_ps"]
    assert pushes >= records * epochs // 8
    ckpt = os.path.join(str(tmp_path), "ckpt")
    versions = complete_versions(ckpt)
    assert versions, "the job wrote no checkpoint"
    for v in versions:   # keep_checkpoint_max=2: the newest two, the last near the end
        state = torch.load(shard_path(version_dir(ckpt, v), 0, 1), weights_only=False)
        ledger = state["ledger"]
        live, closed_bounds = ledger["log"].shape[0], ledger["closed"].numel()
        # the full ledger held every push before v (async: v of them); this one holds
        # the last settle interval's (~2-4 s of pushes: 567 of 6,000 on a quiet machine,
        # 1,219 of 4,800 once the workers ran one torch thread each and pushed faster):
        # a count of time, not of the job's history
        assert v >= 1000 and live <= v // 2, (v, live, pushes)
        assert closed_bounds <= 2 * 32, (v, closed_bounds)
