"""The controller's phase rule (pure: observations in, a phase out) and the
typed replica launches (the argv a replica gets, flag for flag)."""

from __future__ import annotations

from elasticdl.cluster.api import ReplicaType
from elasticdl.common.job_spec import job_spec_from_flags
from elasticdl.master.job_phase import SETTLE_S, JobPhase, Observation, PhaseStep, next_phase
from elasticdl.master.replica_launcher import PSLaunch, ReplicaLauncher, WorkerLaunch

R, F = JobPhase.RUNNING, JobPhase.FINISHING


def test_terminal_phases_are_named():
    assert {p for p in JobPhase if p.is_terminal} == {
        JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED}
    assert F.winding_down and JobPhase.FAILED.winding_down and not R.winding_down


def test_stop_and_failures_end_the_job_whatever_else_holds():
    done = dict(finished=True, exported=True)
    assert next_phase(R, None, Observation(1.0, stop_requested=True, failed=True, **done),
                      60).phase == JobPhase.STOPPED
    step = next_phase(F, 0.0, Observation(1.0, failed=True, **done), 60)
    assert step.phase == JobPhase.FAILED and step.failure is None   # recorded already
    step = next_phase(R, None, Observation(1.0, task_failure=("worker-2", "boom", "tb")), 60)
    assert step == PhaseStep(JobPhase.FAILED, None, ("worker-2", "boom", "tb"))


def test_finishing_waits_for_the_export_and_the_workers_then_succeeds():
    step = next_phase(R, None, Observation(5.0, finished=True, live_workers=2), 60)
    assert step.phase == F and step.since == 5.0
    # exported, workers still up: they get SETTLE_S to exit
    step = next_phase(F, 5.0, Observation(6.0, finished=True, exported=True,
                                          live_workers=1), 60)
    assert step.phase == F and step.since == 5.0
    assert next_phase(F, 5.0, Observation(5.0 + SETTLE_S + 1, finished=True, exported=True,
                                          live_workers=1), 60).phase == JobPhase.SUCCEEDED
    assert next_phase(F, 5.0, Observation(7.0, finished=True, exported=True), 60).phase == \
        JobPhase.SUCCEEDED


def test_finishing_times_out_and_a_reopened_job_runs_again():
    step = next_phase(F, 5.0, Observation(66.0, finished=True, live_workers=1), 60)
    assert step.phase == JobPhase.FAILED and step.failure is not None
    assert step.failure[0] == "master" and "within 60 s" in step.failure[1]
    # a PS rollback reopened training: running again, the finishing clock forgotten
    assert next_phase(F, 5.0, Observation(8.0, live_workers=1), 60) == PhaseStep(R)


def test_no_worker_left_fails_with_the_first_failure():
    step = next_phase(R, None, Observation(1.0, first_failure=("worker-0", "oom", "tb")), 60)
    assert step.failure == ("worker-0", "every worker has failed; first failure: oom", "tb")
    step = next_phase(R, None, Observation(1.0), 60)
    assert step.failure == ("master", "every worker has failed; first failure: every "
                            "worker is gone", "")


def test_replica_argv_is_what_the_controller_always_built():
    spec = job_spec_from_flags("train", {"model_zoo": "z", "model_def": "m.f",
                                         "training_data": "t",
                                         "distribution_strategy": "ParameterServerStrategy",
                                         "num_ps_pods": 2, "envs": "A=1,B=2"})
    launcher = ReplicaLauncher(spec, cluster=None, master_addr="m:1")  # type: ignore[arg-type]
    common = ("--master_addr=m:1", f"--job_spec={spec.to_json()}")
    ps = launcher.replica_spec(PSLaunch(1, 2, 7001, "none", 5, await_rollback=True))
    assert ps.command == ("python", "-m", "elasticdl.ps.main", "--ps_id=1", "--num_ps=2",
                          "--port=7001", "--restore_from=none", "--version_floor=5",
                          "--await_rollback", *common)
    assert (ps.type, ps.index, ps.port, ps.env) == (ReplicaType.PS, 1, 7001,
                                                    {"A": "1", "B": "2",
                                                     "OMP_NUM_THREADS": "1"})  # its cpu=1
    worker = launcher.replica_spec(WorkerLaunch(3, ("a:1", "b:2")))
    assert worker.command == ("python", "-m", "elasticdl.worker.main", "--worker_id=3",
                              "--ps_addrs=a:1,b:2", *common)
    assert launcher.replica_spec(WorkerLaunch(4)).command == (
        "python", "-m", "elasticdl.worker.main", "--worker_id=4", *common)
