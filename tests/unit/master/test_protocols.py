"""Recovery protocols (issue 21): the pure decisions, and a master cut after
every step restoring exactly that step from its journal."""

from __future__ import annotations

import shutil

import pytest

from elasticdl.common.schedule import Schedule
from elasticdl.master.journal import Journal
from elasticdl.master.protocols import (
    Act,
    Kind,
    Observed,
    Protocol,
    Step,
    next_action,
)
from tests.unit.master.test_job_core import FakeWorker, drive
from tests.unit.master.test_journal import full_state, make_core

SOURCE = {"dir": "/ckpt/version-10", "checkpoint": 10}


def rollback(step, incarnation=1, opened_at=0.0, **data):
    return Protocol(1, Kind.ROLLBACK, step, {"launch": [], **SOURCE, **data}, 0, incarnation,
                    opened_at)


def test_rollback_decisions_step_by_step():
    seen = Observed(incarnation=1, now=10.0)
    assert next_action(rollback(Step.REQUESTED, launch=[1]), seen).act == Act.LAUNCH_PS
    assert next_action(rollback(Step.PS_LAUNCHED), seen).act == Act.CHOOSE_VERSION
    assert next_action(rollback(Step.ROLLING_BACK, new_version=120), seen).act == \
        Act.ROLLBACK_ALL
    assert next_action(rollback(Step.REQUEUED), seen).act == Act.CLOSE


def test_a_rolling_back_step_of_an_earlier_master_is_chosen_again():
    """Some PS may have rolled back and moved on: the new master rolls every PS back
    again at a new version, never reuses the old one."""
    action = next_action(rollback(Step.ROLLING_BACK, incarnation=1, new_version=120),
                         Observed(incarnation=2))
    assert action.act == Act.RECHOOSE


def test_a_rollback_past_its_budget_fails_the_job_naming_it():
    action = next_action(rollback(Step.PS_LAUNCHED, opened_at=0.0),
                         Observed(incarnation=1, now=700.0, rollback_budget_s=600.0))
    assert action.act == Act.FAIL and "rollback budget" in action.reason


def export(step, worker=None):
    return Protocol(2, Kind.EXPORT, step, {"worker": worker})


def test_export_decisions():
    live = Observed(incarnation=1, live_workers=frozenset({0, 1}))
    assert next_action(export(Step.CLAIMED, 0), live).act == Act.WAIT
    gone = Observed(incarnation=1, live_workers=frozenset({1}))
    assert next_action(export(Step.CLAIMED, 0), gone).act == Act.EXPORT_LOST
    assert next_action(export(Step.OPEN), gone).act == Act.WAIT   # worker 1 will claim it
    nobody = Observed(incarnation=1)
    assert next_action(export(Step.OPEN), nobody, 1).act == Act.LAUNCH_EXPORTER
    failed = next_action(export(Step.OPEN), nobody, 3)
    assert failed.act == Act.FAIL and "export budget" in failed.reason
    assert next_action(export(Step.WRITTEN, 0), nobody).act == Act.CLOSE


def drive_rollback(core, cut):
    """A PS rollback through every step, a second PS lost in the middle, then the
    final export with a lost exporter; ``cut(i)`` after every transition."""
    workers = [FakeWorker(core, 0), FakeWorker(core, 1)]
    steps = []
    for i in range(6):   # some work done, some held
        (workers[i % 2].finish if workers[i % 2].held else workers[i % 2].take)()
    core.new_incarnation()
    steps.append(lambda: core.ps_lost(1, SOURCE, 5.0))
    steps.append(lambda: core.protocol_step(1, Step.PS_LAUNCHED, launch=[], launched=[1]))
    steps.append(lambda: core.protocol_step(1, Step.ROLLING_BACK, new_version=200))
    steps.append(lambda: core.ps_lost(0, SOURCE, 6.0))        # joins: back to REQUESTED
    steps.append(lambda: core.protocol_step(1, Step.PS_LAUNCHED, launch=[], launched=[0]))
    steps.append(lambda: core.protocol_step(1, Step.ROLLING_BACK, new_version=300))
    steps.append(lambda: core.rollback_requeued(1, {}, 300))
    steps.append(lambda: core.protocol_close(1))
    for i, s in enumerate(steps):
        s()
        cut(i)


@pytest.mark.parametrize("snapshot_at", [None, 2, 5])
def test_master_cut_after_every_protocol_step_restores_that_step(tmp_path, snapshot_at):
    FakeWorker.shared["version"] = 0
    live = make_core()
    live.attach_journal(Journal(str(tmp_path / "live")))
    live.begin()

    def cut(i):
        if i == snapshot_at:
            live.snapshot()
        copy = tmp_path / f"cut{i}"
        shutil.copytree(tmp_path / "live", copy)
        restored = make_core()
        restored.restore(Journal(str(copy)))
        assert full_state(restored) == full_state(live), f"after step {i}"
        assert [p.to_json() for p in restored.open_protocols()] == \
            [p.to_json() for p in live.open_protocols()]

    drive_rollback(live, cut)
    assert live.protocols.rollbacks_done == 1 and not live.open_protocols()
    assert live.state_dict()["report"]["extra"]["ps_rollbacks"] == [
        {"checkpoint_version": 10, "new_version": 300}]


def finished_core(journal_dir=None, export_requires_training: bool = False):
    """A core whose one worker (0) trained every task: the job is done, the export due."""
    FakeWorker.shared["version"] = 0
    core = make_core()
    core.export_requires_training = export_requires_training
    if journal_dir is not None:
        core.attach_journal(Journal(str(journal_dir)))
    core.begin()
    w = FakeWorker(core, 0)
    while not core.finished():
        (w.finish if w.held else w.take)()
    return core


def test_export_claim_lost_and_taken_over_survives_cuts(tmp_path):
    live = finished_core(tmp_path / "live")
    assert live.claim_export(0) and not live.claim_export(1)
    assert live.exporter() == 0 and live.export_pending()
    pid = live.open_protocols()[0].pid
    live.export_lost(pid)                      # worker 0 died before writing
    assert live.claim_export(1) and live.exporter() == 1
    assert not live.export_written(0, "/late")   # the replaced exporter's late report
    assert live.export_written(1, "/out/model.pt")
    copy = tmp_path / "cut"
    shutil.copytree(tmp_path / "live", copy)
    restored = make_core()
    restored.restore(Journal(str(copy)))
    assert [p.to_json() for p in restored.open_protocols()] == \
        [p.to_json() for p in live.open_protocols()]
    live.protocol_close(pid)
    assert live.exported == "/out/model.pt" and not live.export_pending()
    assert not live.claim_export(2)


def test_a_worker_id_journaled_before_its_launch_is_never_reused(tmp_path):
    live = make_core()
    live.attach_journal(Journal(str(tmp_path / "live")))
    assert [live.launch_worker() for _ in range(2)] == [0, 1]
    live.replica_gone(1, False, "worker:1", False)
    assert live.launch_worker(lineage=1) == 2     # journaled: the master dies here
    restored = make_core()
    restored.restore(Journal(str(tmp_path / "live")))
    assert restored.replicas.live_workers == {0, 2}
    assert restored.launch_worker() == 3


def test_case7_evaluation_interrupted_by_a_rollback_runs_again_on_the_model_as_it_is():
    """A PS rollback while an evaluation runs: its metrics (of a model the PS no longer
    hold) are dropped and the evaluation runs again on the rolled-back model, labelled
    with the version it then has; every reported evaluation's label is what its tasks
    evaluated (FakeWorker reports the version it saw as the metric)."""
    from elasticdl.common.task import TaskType

    FakeWorker.shared["version"] = 0
    core = make_core()
    core.begin()
    workers = [FakeWorker(core, 0), FakeWorker(core, 1)]
    for _ in range(1000):
        task = workers[0].take()
        if task.type == TaskType.EVALUATION:
            break
        if workers[0].held:
            workers[0].finish()
    interrupted = core.state_dict()["evaluation"]["running"]
    assert interrupted is not None
    p = core.ps_lost(1, SOURCE, 0.0)
    core.protocol_step(p.pid, Step.PS_LAUNCHED, launch=[], launched=[1])
    core.protocol_step(p.pid, Step.ROLLING_BACK, new_version=500)
    assert not core.finished()
    FakeWorker.shared["version"] = 500     # what the PS now hold
    core.rollback_requeued(p.pid, {}, 500)
    core.protocol_close(p.pid)
    assert core.state_dict()["evaluation"]["running"] is None
    drive(core, workers)      # worker 0 first reports the dropped evaluation task
    evaluations = core.report.evaluations
    assert interrupted["version"] not in [e["model_version"] for e in evaluations]
    for e in evaluations:
        assert e["metrics"]["seen_version"] == e["model_version"], evaluations
    rerun = [e for e in evaluations if e["model_version"] >= 500]
    assert rerun and set(interrupted["reasons"]) <= set(rerun[0]["reasons"]), evaluations


def test_allreduce_export_only_by_a_worker_that_trained():
    """Campaign finding: an allreduce worker relaunched after training (it never got
    a task, so it holds no trained model) claimed the export of a dead exporter and
    wrote an untrained model. Only workers that trained may claim; with none left
    the job fails naming the export budget (a PS job launches one instead)."""
    core = finished_core(export_requires_training=True)
    assert not core.claim_export(7)           # relaunched after training: refused
    assert core.claim_export(0)
    seen = Observed(incarnation=0, live_workers=frozenset(), can_launch_exporter=False)
    pid = core.open_protocols()[0].pid
    core.export_lost(pid)
    action = next_action(core.open_protocols()[0], seen, 1)
    assert action.act == Act.FAIL and "no live worker holds the trained model" in \
        action.reason


@pytest.mark.parametrize("claimed_first", [True, False])
def test_allreduce_export_from_the_final_checkpoint_survives_cuts(tmp_path, claimed_first):
    """Every member that trained is gone (the exporter last, or before anyone claimed):
    the master opens the export with the final checkpoint as its source; a worker that
    did not train claims it and is told to load that checkpoint first. The source and
    the claim replay from the journal."""
    live = finished_core(tmp_path / "live", export_requires_training=True)
    if claimed_first:
        assert live.claim_export(0)
        live.export_lost(live.open_protocols()[0].pid)   # died after writing the checkpoint
    assert not live.claim_export(7)                       # no source yet: refused
    live.open_export("/ckpt/version-40")
    assert live.export_source() == "/ckpt/version-40"
    seen = Observed(incarnation=0, live_workers=frozenset(), can_launch_exporter=True)
    assert next_action(live.open_protocols()[0], seen, 1).act == Act.LAUNCH_EXPORTER
    assert live.claim_export(7) and live.exporter() == 7
    assert live.exporter_load() == "/ckpt/version-40"
    copy = tmp_path / "cut"
    shutil.copytree(tmp_path / "live", copy)
    restored = make_core()
    restored.export_requires_training = True
    restored.restore(Journal(str(copy)))
    assert [p.to_json() for p in restored.open_protocols()] == \
        [p.to_json() for p in live.open_protocols()]
    assert restored.exporter_load() == "/ckpt/version-40"
    assert live.export_written(7, "/out/model.pt")


def test_no_final_checkpoint_leaves_the_export_to_its_budget(tmp_path):
    """Without a source the opened export fails naming its budget, and only a worker
    that trained could claim it."""
    core = finished_core(export_requires_training=True)
    core.open_export(None)
    assert core.export_source() is None and not core.claim_export(7)
    seen = Observed(incarnation=0, live_workers=frozenset(), can_launch_exporter=False)
    action = next_action(core.open_protocols()[0], seen, 0)
    assert action.act == Act.FAIL and "export budget" in action.reason


def test_a_rollback_that_reopens_an_earlier_epoch_still_ends_with_a_final_evaluation():
    """CI finding: a divergence rollback in epoch 1 re-queued the done tasks of epochs 0
    and 1; epoch 1 ended first, then epoch 0 again, and no final evaluation ran after
    it: the report kept the collapsed model's accuracy (0.1, an epoch-end evaluation
    before the rollback) as ``final_metrics`` of a job whose model ended at 0.96. The
    final evaluation follows the last training record, whichever epoch it belongs to."""
    from elasticdl.common.task import TaskType

    FakeWorker.shared["version"] = 0
    core = make_core(clock=lambda: 1000.0)   # no task times out
    core.schedule = Schedule()   # no periodic evaluation: it would wait for worker 1's task
    core.begin()
    w0, w1 = FakeWorker(core, 0), FakeWorker(core, 1)
    epoch1_done = 0
    while epoch1_done < 3:     # into epoch 1: three of its tasks done
        w0.take()
        if w0.held:
            done = w0.finish()
            epoch1_done += done.type == TaskType.TRAINING and done.epoch == 1
    p = core.ps_lost(1, SOURCE, 0.0)
    core.protocol_step(p.pid, Step.PS_LAUNCHED, launch=[], launched=[1])
    core.protocol_step(p.pid, Step.ROLLING_BACK, new_version=500)
    FakeWorker.shared["version"] = 500
    core.rollback_requeued(p.pid, {}, 500)
    core.protocol_close(p.pid)
    while not (w1.held and w1.held[0].epoch == 0):   # worker 1 keeps a task of epoch 0
        if w1.held:
            w1.finish()
        w1.take()
    held = w1.held[0]
    while core.tm.training_records_left() > held.num_records or w0.held:
        w0.take()              # worker 0 trains the rest: epoch 1 ends first
        if w0.held:
            w0.finish()
    drive(core, [w1, w0])      # then epoch 0, again
    evaluations = core.report.evaluations
    assert evaluations[-1]["epoch"] == 0, evaluations   # the epoch that ended last
    finals = [e for e in evaluations if "final" in e["reasons"]]
    assert len(finals) == 1 and finals[0] is evaluations[-1], evaluations
    assert finals[0]["model_version"] == FakeWorker.shared["version"] > 500
    assert core.report.final_metrics == finals[0]["metrics"]
