"""``--ps_recovery=alone`` in the job core: the protocol's record and report, what its
re-queue keeps, and the staleness rule by ledger generation (the integration test:
tests/integration/test_ps_recovery_alone.py)."""

from __future__ import annotations

import shutil

from elasticdl.master.journal import Journal
from elasticdl.master.protocols import Step
from elasticdl.master.task_manager import TaskManager
from tests.unit.master.test_job_core import FakeWorker
from tests.unit.master.test_journal import full_state, make_core

ALONE = {"dir": "/ckpt/version-10", "checkpoint": 10, "alone": True}


def test_a_lone_recovery_survives_a_cut_after_every_step_and_reports_itself(tmp_path):
    FakeWorker.shared["version"] = 0
    live = make_core()
    live.attach_journal(Journal(str(tmp_path / "live")))
    live.begin()
    workers = [FakeWorker(live, 0), FakeWorker(live, 1)]
    for i in range(6):
        (workers[i % 2].finish if workers[i % 2].held else workers[i % 2].take)()
    live.new_incarnation()
    steps = [
        lambda: live.ps_lost(1, ALONE, 5.0),
        lambda: live.protocol_step(1, Step.PS_LAUNCHED, launch=[], launched=[1], restore=[1]),
        lambda: live.protocol_step(1, Step.ROLLING_BACK, new_version=200),
        lambda: live.ps_lost(2, None, 6.0),   # joins: back to REQUESTED, alone kept
        lambda: live.protocol_step(1, Step.PS_LAUNCHED, launch=[], launched=[2],
                                   restore=[1, 2]),
        lambda: live.protocol_step(1, Step.ROLLING_BACK, new_version=300),
        lambda: live.rollback_requeued(1, {}, 300),
        lambda: live.protocol_close(1),
    ]
    for i, s in enumerate(steps):
        s()
        if i == 3:
            p = live.open_protocols()[0]
            assert p.step == Step.REQUESTED and p.data["alone"] and p.data["launch"] == [2]
        copy = tmp_path / f"cut{i}"
        shutil.copytree(tmp_path / "live", copy)
        restored = make_core()
        restored.restore(Journal(str(copy)))
        assert full_state(restored) == full_state(live), f"after step {i}"
    extra = live.state_dict()["report"]["extra"]
    assert "ps_rollbacks" not in extra
    [entry] = extra["ps_recoveries"]
    assert entry["ps"] == [1, 2] and entry["checkpoint_version"] == 10
    assert entry["new_version"] == 300 and entry["tasks_requeued"] >= 1
    assert entry["records_requeued"] > 0


def _done(tm: TaskManager, worker: int, counters: dict[str, int]) -> int:
    t = tm.get(worker)
    tm.report(t.task_id, worker, True, counters={"records_applied": t.num_records,
                                                 **counters})
    return t.task_id


def test_the_requeue_keeps_a_task_read_after_the_restore_and_reopens_one_read_before():
    tm = TaskManager([("a", 0, 8)], records_per_task=4, settle_on_close=False)
    before = _done(tm, 1, {"applied_at_version": 12, "applied_generation": 0})
    after = _done(tm, 1, {"applied_at_version": 40, "applied_generation": 150})
    # the restored PS's ledger holds neither (restored from before both)
    assert tm.rollback({}, new_version=150) == [before]
    assert after in tm.completed and before not in tm.completed


def test_a_figure_read_below_the_generation_is_stale_whatever_its_versions():
    tm = TaskManager([("a", 0, 8)], records_per_task=4)
    tm.rollback({}, new_version=150)
    # a lone restore: the others' versions stay below 150, the generation tells
    stale = _done(tm, 1, {"applied_at_version": 400, "applied_generation": 20})
    assert stale not in tm.completed
    fresh = _done(tm, 1, {"applied_at_version": 60, "applied_generation": 150})
    assert fresh in tm.completed
    # a worker that sends no generation: its versions, as before
    old = _done(tm, 2, {"applied_at_version": 60})
    assert old not in tm.completed
