"""Chaos through the real CLI: kill -9 replicas of running digits jobs.

ParameterServerStrategy: a worker and then the PS are SIGKILLed mid-run; the
worker is relaunched with a new id, the PS from its latest checkpoint.
AllreduceStrategy: one of 3 workers is SIGKILLed; the survivors go on without
restarting, the relaunched worker rejoins. Both: the job succeeds, every
epoch's records_completed equals the dataset size, accuracy >= 0.94.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from elasticdl.checkpoint.paths import complete_versions
from tests.conftest import FIXTURE_ZOO, MODEL_ZOO
from tests.integration.helpers import (  # pid_of, records_done: also imported from here
    cli_env,
    kill_job_tree,
    live_replicas,
    pid_of,
    pid_running,
    read_json,
    records_done,
    start_cli,
    wait_for,
)

pytestmark = pytest.mark.integration


def train_args(digits, out, job, zoo=MODEL_ZOO, model_def="digits.digits_cnn.custom_model",
               **flags):
    args = ["train", f"--model_zoo={zoo}", f"--model_def={model_def}",
            f"--training_data={digits}/train", f"--validation_data={digits}/val",
            f"--output={out}", f"--job_name={job}", "--cluster=local"]
    return args + [f"--{k}={v}" for k, v in flags.items()]


def check_report(job_dir, epochs, min_accuracy: float = 0.94):
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", (report.get("failure"), report.get("training_health"))
    assert [e["records_completed"] for e in report["epochs"]] == [1437] * epochs
    # the final model (evaluated at the exported version since issue 9) of these short
    # 6-epoch jobs scores 0.95-0.97; 342/360 = 0.95 exactly came out as 0.9499999987
    assert report["final_metrics"]["accuracy"] >= min_accuracy, report["evaluations"]
    return report


def test_ps_job_survives_worker_and_ps_kills(digits_data, tmp_path):
    job_dir = str(tmp_path / "ps")
    ckpt = str(tmp_path / "ckpt")
    # 12 epochs: with one torch thread a replica, 6 could end before the PS kill landed
    proc = start_cli(train_args(digits_data, job_dir, "chaos-ps", num_epochs=12,
                                distribution_strategy="ParameterServerStrategy",
                                num_workers=2, num_ps_pods=1, checkpoint_dir=ckpt,
                                checkpoint_steps=10),
                     str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        wait_for(lambda: records_done(job_dir) >= 300, 180, "training under way")
        os.kill(wait_for(lambda: pid_of(job_dir, "worker-1"), 30, "worker-1"), signal.SIGKILL)
        wait_for(lambda: complete_versions(ckpt), 120, "a PS checkpoint")
        wait_for(lambda: records_done(job_dir) >= 2500, 180, "more training")
        os.kill(wait_for(lambda: pid_of(job_dir, "ps-0"), 30, "ps-0"), signal.SIGKILL)
        code = proc.wait(timeout=400)
        assert code == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = check_report(job_dir, 12)
    relaunched = {(r["replica"], r["new_replica"], r["reason"]) for r in report["relaunches"]}
    assert ("worker-1", "worker-2", "killed") in relaunched
    assert ("ps-0", "ps-0", "killed") in relaunched
    ps_log = open(os.path.join(job_dir, "logs", "ps-0.log")).read()
    assert re.search(r"restor\w* .*version-\d+", ps_log, re.IGNORECASE), ps_log[-2000:]
    assert os.path.exists(os.path.join(job_dir, "model.pt"))


def test_allreduce_job_survives_a_worker_kill(digits_data, tmp_path):
    job_dir = str(tmp_path / "ar")
    # 6 epochs trained in 4.5 s once under way: a CI run found the job done (worker-1
    # exited) before the report (written every few s) showed 400 records; 24 take ~18 s
    proc = start_cli(train_args(digits_data, job_dir, "chaos-ar", num_epochs=24,
                                distribution_strategy="AllreduceStrategy", num_workers=3,
                                minibatch_size=32, collective_timeout_s=10),
                     str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        wait_for(lambda: records_done(job_dir) >= 400, 180, "training under way")
        survivors = {r: pid_of(job_dir, r) for r in ("worker-0", "worker-2")}
        os.kill(wait_for(lambda: pid_of(job_dir, "worker-1"), 30, "worker-1"), signal.SIGKILL)
        code = proc.wait(timeout=400)
        assert code == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = check_report(job_dir, 24)
    assert [(r["replica"], r["new_replica"]) for r in report["relaunches"]] == [
        ("worker-1", "worker-3")]
    # the survivors were never restarted: one process each, exiting 0 at the end
    exited = read_json(os.path.join(job_dir, "replicas.json"))["exited"]
    for name, pid in survivors.items():
        runs = [e for e in exited if e["replica"] == name]
        assert [(e["pid"], e["exit_code"]) for e in runs] == [(pid, 0)], runs
    master_log = open(os.path.join(job_dir, "logs", "master.log")).read()
    plans = re.findall(r"plan \d+ published: workers \[([\d, ]+)\]", master_log)
    assert any("3" in p.split(", ") for p in plans), plans  # the relaunched worker joined


def all_pids(job_dir):
    state = read_json(os.path.join(job_dir, "replicas.json")) or {}
    pids = [r["pid"] for r in state.get("replicas", [])] + \
        [r["pid"] for r in state.get("exited", [])]
    master = read_json(os.path.join(job_dir, "master.json")) or {}
    return pids + ([master["pid"]] if "pid" in master else [])


def test_master_survives_repeated_worker_kills(digits_data, tmp_path):
    """Issue 11: the master crashed in a relaunch (replicas.json written by two
    threads through one temp file). Six kill -9s in quick succession, each
    relaunch racing the reaper: the master stays up and the job succeeds."""
    job_dir = str(tmp_path / "kills")
    # 30 epochs: with one torch thread a replica the job trains fast enough that 4 epochs
    # could end before the sixth kill (and the loop below then waited for ever), and a
    # CI run saw 10 end after the third
    proc = start_cli(train_args(digits_data, job_dir, "chaos-kills", num_epochs=30,
                                distribution_strategy="ParameterServerStrategy",
                                num_workers=2, num_ps_pods=1, grads_to_wait=1),
                     str(tmp_path / "home"), str(tmp_path / "cli.log"))
    killed = []
    try:
        wait_for(lambda: records_done(job_dir) >= 200, 180, "training under way")
        deadline = time.monotonic() + 180
        while len(killed) < 6:
            assert proc.poll() is None, f"the job ended after {len(killed)} kills: {killed}"
            assert time.monotonic() < deadline, f"only {len(killed)} kills in 180 s"
            workers = [r for r in live_replicas(job_dir) if r["replica"].startswith("worker-")
                       and r["replica"] not in killed]
            if workers:
                victim = workers[len(killed) % len(workers)]
                try:
                    os.kill(victim["pid"], signal.SIGKILL)
                    killed.append(victim["replica"])
                except ProcessLookupError:
                    pass
            time.sleep(0.3)
        code = proc.wait(timeout=400)
        assert code == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    assert [e["records_completed"] for e in report["epochs"]] == [1437] * 30
    relaunched = {r["replica"] for r in report["relaunches"]}
    assert set(killed) <= relaunched, (killed, report["relaunches"])
    master_log = open(os.path.join(job_dir, "logs", "master.log")).read()
    assert "Traceback" not in master_log, master_log[-3000:]


@pytest.fixture
def toy_data(tmp_path):
    sys.path.insert(0, FIXTURE_ZOO)
    from toy import linear

    linear.write_data(str(tmp_path / "train"), n=400)
    linear.write_data(str(tmp_path / "val"), n=100, seed=1)
    return tmp_path


def toy_args(tmp, job, **flags):
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", f"--training_data={tmp}/train",
            f"--validation_data={tmp}/val", f"--output={tmp}/out", f"--job_name={job}",
            "--cluster=local", "--minibatch_size=16", "--num_minibatches_per_task=4"]
    return args + [f"--{k}={v}" for k, v in flags.items()]


@pytest.mark.parametrize("strategy", ["ParameterServerStrategy", "AllreduceStrategy"])
def test_nan_loss_fails_the_job_naming_it(toy_data, strategy):
    """Issue 11: a loss that turns NaN used to end `succeeded` with a NaN model."""
    tmp = toy_data
    proc = start_cli(toy_args(tmp, "chaos-nan", model_def="toy.nan.custom_model",
                              distribution_strategy=strategy, num_workers=2, num_ps_pods=1,
                              max_task_retries=2, num_epochs=2),
                     str(tmp / "home"), str(tmp / "cli.log"), TOY_NAN_FROM_ID="250",
                     TOY_NAN_MODE="loss")
    try:
        code = proc.wait(timeout=300)
    finally:
        kill_job_tree(proc, str(tmp / "out"))
    log = (tmp / "cli.log").read_text()
    assert code == 1, log[-4000:]
    report = read_json(str(tmp / "out" / "job_report.json"))
    assert report["status"] == "failed"
    assert "non-finite loss" in report["failure"]["error"], report["failure"]
    assert "non-finite loss" in log
    assert not (tmp / "out" / "model.pt").exists()
    wait_for(lambda: not any(pid_running(p) for p in all_pids(str(tmp / "out"))), 30,
             "every process of the failed job to exit")


def test_killed_master_fails_the_job_and_leaves_nothing_running(toy_data):
    """Issue 11: the report stayed `running` and the PS were orphaned. (Issue 13:
    with master restarts exhausted; by default the master is relaunched.)"""
    tmp = toy_data
    out = str(tmp / "out")
    proc = start_cli(toy_args(tmp, "chaos-master", model_def="toy.linear.custom_model",
                              distribution_strategy="ParameterServerStrategy", num_workers=2,
                              num_ps_pods=1, num_epochs=50, max_master_restarts=0),
                     str(tmp / "home"), str(tmp / "cli.log"), TOY_FEED_DELAY_S="0.02")
    try:
        wait_for(lambda: records_done(out) >= 400, 180, "training under way")
        pids = all_pids(out)
        master = read_json(os.path.join(out, "master.json"))["pid"]
        os.kill(master, signal.SIGKILL)
        code = proc.wait(timeout=60)
        assert code == 1, (tmp / "cli.log").read_text()[-3000:]
        report = read_json(os.path.join(out, "job_report.json"))
        assert report["status"] == "failed"
        assert report["failure"]["replica"] == "master"
        assert "exited with code -9" in report["failure"]["error"]
        wait_for(lambda: not any(pid_running(p) for p in pids), 15, "replicas to be gone")
    finally:
        kill_job_tree(proc, out)


def test_typo_flag_exits_2_fast_with_nothing_started(tmp_path):
    """Issue 11: `--num_worker=3` trained the whole job, then complained."""
    out = tmp_path / "out"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "elasticdl_client.main",
                        *toy_args(tmp_path, "typo", model_def="toy.linear.custom_model"),
                        "--num_worker=3"], capture_output=True, text=True, timeout=60,
                       env=cli_env(str(tmp_path / "home")))
    elapsed = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    assert "unknown flag --num_worker; did you mean --num_workers?" in r.stderr
    assert not out.exists() and not (tmp_path / "home").exists()
    assert elapsed < 2.0 or os.getloadavg()[0] > 2, elapsed  # loaded machine: bound is loose


def _hung_exclusion_logged(job_dir, worker_id):
    try:
        log = open(os.path.join(job_dir, "logs", "master.log")).read()
    except OSError:
        return False
    return f"worker {worker_id} did not check in" in log


def test_allreduce_sigstopped_member_is_excluded_killed_and_relaunched(digits_data, tmp_path):
    """Issue 11: a hung (SIGSTOPped) member is left out of the next plan within
    --collective_timeout_s + 5 s, the master stops and relaunches it, the job succeeds."""
    import time

    job_dir = str(tmp_path / "ar-hung")
    timeout_s = 5
    # 20 epochs: with one torch thread a replica, 6 could be over before worker-1 was
    # looked up (alone on a quiet machine)
    proc = start_cli(train_args(digits_data, job_dir, "chaos-ar-hung", num_epochs=20,
                                distribution_strategy="AllreduceStrategy", num_workers=3,
                                minibatch_size=32, collective_timeout_s=timeout_s),
                     str(tmp_path / "home"), str(tmp_path / "cli.log"))
    stopped = None
    try:
        wait_for(lambda: records_done(job_dir) >= 400, 180, "training under way")
        stopped = wait_for(lambda: pid_of(job_dir, "worker-1"), 30, "worker-1")
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for(lambda: _hung_exclusion_logged(job_dir, 1), timeout_s + 30, "exclusion")
        excluded_after = time.monotonic() - t0
        code = proc.wait(timeout=400)
        assert code == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        kill_job_tree(proc, job_dir)
    assert excluded_after <= timeout_s + 5, excluded_after
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    assert [e["records_completed"] for e in report["epochs"]] == [1437] * 20
    assert report["final_metrics"]["accuracy"] >= 0.9, report["evaluations"]
    assert ("worker-1", "worker-3") in [(r["replica"], r["new_replica"])
                                        for r in report["relaunches"]], report["relaunches"]
    master_log = open(os.path.join(job_dir, "logs", "master.log")).read()
    plans = re.findall(r"plan \d+ published: workers \[([\d, ]+)\]", master_log)
    assert any("3" in p.split(", ") for p in plans), plans  # the relaunched worker joined
