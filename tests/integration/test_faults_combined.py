"""Issue 21: faults in combination, each a deterministic test. Processes SIGKILL
themselves at named points of the recovery protocols (ELASTICDL_FAULT_POINTS);
every test asserts on the exported model, with the record-counting fixture, that
each record was trained exactly once per epoch (tests/integration/fault_harness.py)."""

from __future__ import annotations

import pytest

from tests.integration.fault_harness import (
    EPOCHS,
    assert_trained_exactly,
    logs_of,
    ps_job,
    worker_processes,
)

pytestmark = pytest.mark.integration

PS_DIES = "ps-1:after_version@12"   # after a complete checkpoint (every 5 versions)


def test_case1_master_dies_after_rollback_start(id_data, tmp_path):
    """A PS dies; the master journals ROLLING_BACK(new version) and dies before any
    rollback RPC. The restarted master resumes the open protocol (a step of an
    earlier incarnation: chooses again), restores the lost PS alone (the default
    --ps_recovery=alone), re-queues: one recovery, no hang."""
    run = ps_job(tmp_path, id_data, "case1", f"{PS_DIES},master:after_rollback_start")
    report = assert_trained_exactly(run, EPOCHS, ("ps-1_after_version@12",
                                                  "master_after_rollback_start@1"))
    assert len(report["master_restarts"]) == 1
    assert [r["ps"] for r in report["ps_recoveries"]] == [[1]], report["ps_recoveries"]
    assert "ps_rollbacks" not in report


def test_case2_master_dies_after_every_ps_rolled_back(id_data, tmp_path):
    """Every PS rolled back, the master dies before the core re-queued what the
    rollback erased: the restarted master rolls back again and re-queues
    (--ps_recovery=rollback_all: the rollback of every PS is what this tests)."""
    run = ps_job(tmp_path, id_data, "case2", f"{PS_DIES},master:after_ps_rollback",
                 ps_recovery="rollback_all")
    report = assert_trained_exactly(run, EPOCHS, ("master_after_ps_rollback@1",))
    assert len(report["ps_rollbacks"]) == 1, report["ps_rollbacks"]


def test_two_ps_deaths_make_one_rollback(id_data, tmp_path):
    """Suspicion: two PS deaths ran two rollback threads, the last one winning.
    PS 0 dies inside the rollback of PS 1's death (after restoring, before it
    answers): it joins the open rollback; one rollback, one checkpoint
    (--ps_recovery=rollback_all: PS 0 dies in its rollback)."""
    run = ps_job(tmp_path, id_data, "twops", f"{PS_DIES},ps-0:after_restore",
                 ps_recovery="rollback_all")
    report = assert_trained_exactly(run, EPOCHS, ("ps-0_after_restore@1",))
    assert len(report["ps_rollbacks"]) == 1, report["ps_rollbacks"]
    assert "joins it" in logs_of(run["job_dir"], "master")


def test_ps_death_then_master_death_before_ps_launch(id_data, tmp_path):
    """PS, then master (after PS_LAUNCHED is journaled, before the PS is created);
    --ps_recovery=rollback_all (case 1 covers a master death in a lone recovery)."""
    run = ps_job(tmp_path, id_data, "psmaster", f"{PS_DIES},master:after_ps_launched",
                 ps_recovery="rollback_all")
    report = assert_trained_exactly(run, EPOCHS, ("master_after_ps_launched@1",))
    assert len(report["ps_rollbacks"]) == 1, report["ps_rollbacks"]
    # the restarted master relaunches the PS at the address the workers hold (at a new
    # port they retried the old one for 120 s, then failed their tasks)
    assert "did not come back" not in logs_of(run["job_dir"], "master")


# ----------------------------------------------------------------- case 8: export
@pytest.mark.parametrize("point", ["before_export", "after_export"])
def test_case8_exporter_dies_and_is_replaced(id_data, tmp_path, point):
    """The worker exporting the final model dies (before writing it, or after writing
    it but before reporting it): the export opens again and the other worker, which
    waits while the export is open, takes it over; the job never hangs."""
    run = ps_job(tmp_path, id_data, f"case8-{point}".replace("_", "-"), f"exporter:{point}")
    report = assert_trained_exactly(run, EPOCHS, (f"exporter_{point}@1",))
    assert "the final export is open again" in logs_of(run["job_dir"], "master")
    assert report["status"] == "succeeded"


@pytest.mark.parametrize("point", ["after_export_claim", "after_export_written"])
def test_master_dies_during_the_final_export(id_data, tmp_path, point):
    """The master dies with the export claim journaled but its order not yet sent (the
    restarted master gives the claimant the order again when it asks), or with the
    export's report journaled but not answered (the restarted master ends the job):
    the model is exported once, exact, and the job ends succeeded."""
    run = ps_job(tmp_path, id_data, f"export-{point}".replace("_", "-"), f"master:{point}")
    report = assert_trained_exactly(run, EPOCHS, (f"master_{point}@1",))
    assert report["status"] == "succeeded"
    log = logs_of(run["job_dir"], "master")
    assert "restored the job core" in log
    assert "does not hold" not in log   # a retried report is recognised as such


def test_case8_last_worker_exporting_dies(id_data, tmp_path):
    """With one worker, its death while exporting leaves nobody: a worker is launched
    for the export (PS hold the model)."""
    run = ps_job(tmp_path, id_data, "case8-alone", "exporter:before_export", num_workers=1)
    assert_trained_exactly(run, EPOCHS, ("exporter_before_export@1",))
    assert "launched worker-" in logs_of(run["job_dir"], "master")


# ------------------------------------------------------------ case 4: worker ids
@pytest.mark.parametrize("point", ["after_launch_intent", "after_relaunch"])
def test_case4_worker_id_never_reused_after_master_kill(id_data, tmp_path, point):
    """Worker 1 dies; the master journals the relaunch's new id before creating it and
    dies (before the create, or after it and before a snapshot). The restarted master
    never launches a second process under one id, nor relaunches a worker twice."""
    from elasticdl.worker.ps_trainer import KILL_AFTER_STEPS_ENV

    # the 3rd launch intent is the relaunch's (workers 0 and 1 took the first two); a
    # relaunch is reached once, so after_relaunch fires at its first
    at = "@3" if point == "after_launch_intent" else "@1"
    run = ps_job(tmp_path, id_data, f"case4-{point}".replace("_", "-"),
                 f"master:{point}{at}", envs=f"{KILL_AFTER_STEPS_ENV}=1:6")
    report = assert_trained_exactly(run, EPOCHS, (f"master_{point}{at}",))
    assert len(report["master_restarts"]) == 1
    procs = worker_processes(run["job_dir"])
    assert all(len(pids) == 1 for pids in procs.values()), procs
    lineages = [r for r in report["relaunches"] if r["replica"] == "worker-1"]
    assert len(lineages) <= 1, report["relaunches"]


# ------------------------------------------------------- case 9: before launching
def test_case9_master_dies_before_launching_workers(id_data, tmp_path):
    run = ps_job(tmp_path, id_data, "case9", "master:before_start")
    report = assert_trained_exactly(run, EPOCHS, ("master_before_start@1",))
    assert len(report["master_restarts"]) == 1
