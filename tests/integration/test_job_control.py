"""`elasticdl status|logs|stop` and Ctrl-C on real local jobs: nothing is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import FIXTURE_ZOO, ROOT
from tests.integration.helpers import (
    cli_env,
    kill_job_tree,
    live_replicas,
    pid_running,
    read_json,
    start_cli,
    wait_for,
)
from tests.integration.test_local_cluster import predict_args, toy_checkpoint  # noqa: F401

pytestmark = pytest.mark.integration


def all_pids(job_dir: str) -> list[int]:
    master = (read_json(os.path.join(job_dir, "master.json")) or {}).get("pid")
    return [master] + [r["pid"] for r in live_replicas(job_dir)]


def cli(home, *args):
    return subprocess.run([sys.executable, "-m", "elasticdl_client.main", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=cli_env(home))


def slow_job(tmp, job):
    return predict_args(tmp, job, tmp / "predict", minibatch_size=10,
                        num_minibatches_per_task=2, envs="TOY_FEED_DELAY_S=0.5")


def wait_running(job_dir):
    return wait_for(lambda: len(live_replicas(job_dir)) == 3 and all_pids(job_dir), 120,
                    "3 running workers")


def test_status_logs_and_stop(toy_checkpoint):  # noqa: F811
    tmp = toy_checkpoint
    home, job_dir = str(tmp / "home"), str(tmp / "stopme")
    proc = start_cli(slow_job(tmp, "stopme"), home, str(tmp / "cli.log"))
    try:
        pids = wait_running(job_dir)
        wait_for(lambda: "worker 1" in open(os.path.join(job_dir, "logs",
                                                          "worker-1.log")).read()
                 or "elasticdl.worker" in open(os.path.join(job_dir, "logs",
                                                              "worker-1.log")).read(),
                 60, "worker-1 logging")
        # the same job again, into the running one's directory: refused, nothing wiped
        again = cli(home, *slow_job(tmp, "stopme"))
        assert again.returncode == 2, again.stderr
        assert "already running in" in again.stderr and "elasticdl stop stopme" in again.stderr
        assert os.path.exists(os.path.join(job_dir, "journal"))
        st = cli(home, "status", "stopme")
        assert st.returncode == 0 and "master running" in st.stdout
        assert "worker-1" in st.stdout
        logs = cli(home, "logs", "stopme", "--replica=worker-1")
        assert logs.returncode == 0 and "start worker-1" in logs.stdout
        missing = cli(home, "logs", "stopme", "--replica=worker-9")
        assert missing.returncode == 2 and "worker-9" in missing.stderr
        stopped = cli(home, "stop", "stopme")
        assert stopped.returncode == 0 and "master" in stopped.stdout
        assert proc.wait(timeout=60) != 0
        wait_for(lambda: not any(pid_running(p) for p in pids), 30, "every process gone")
        assert cli(home, "status", "nosuchjob").returncode == 2
    finally:
        kill_job_tree(proc, job_dir)


def test_ctrl_c_tears_everything_down(toy_checkpoint):  # noqa: F811
    tmp = toy_checkpoint
    home, job_dir = str(tmp / "home"), str(tmp / "ctrlc")
    proc = start_cli(slow_job(tmp, "ctrlc"), home, str(tmp / "cli.log"), terminal=True)
    try:
        pids = wait_running(job_dir)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert proc.wait(timeout=60) == 130
        wait_for(lambda: not any(pid_running(p) for p in pids), 30, "every process gone")
        report = read_json(os.path.join(job_dir, "job_report.json"))
        assert report["status"] == "stopped"
    finally:
        kill_job_tree(proc, job_dir)


@pytest.mark.parametrize("signum, to_group", [(signal.SIGTERM, False), (signal.SIGHUP, True)])
def test_sigterm_and_sighup_stop_the_job_like_ctrl_c(toy_checkpoint, signum, to_group):  # noqa: F811
    """`timeout` SIGTERMs the client alone; a closed terminal SIGHUPs its process group.
    Master, PS and workers run in their own sessions: the client must stop them."""
    tmp = toy_checkpoint
    name = signal.Signals(signum).name.lower()
    home, job_dir = str(tmp / "home"), str(tmp / name)
    proc = start_cli(slow_job(tmp, name), home, str(tmp / "cli.log"))
    try:
        pids = wait_running(job_dir)
        if to_group:
            os.killpg(proc.pid, signum)
        else:
            os.kill(proc.pid, signum)
        assert proc.wait(timeout=60) == 128 + signum, (tmp / "cli.log").read_text()[-2000:]
        wait_for(lambda: not any(pid_running(p) for p in pids), 30, "every process gone")
        report = read_json(os.path.join(job_dir, "job_report.json"))
        assert report["status"] == "stopped"
        assert f"interrupted ({signal.Signals(signum).name})" in (tmp / "cli.log").read_text()
    finally:
        kill_job_tree(proc, job_dir)


def test_a_sigkilled_client_leaves_a_job_that_status_shows_and_stop_ends(toy_checkpoint):  # noqa: F811
    tmp = toy_checkpoint
    home, job_dir = str(tmp / "home"), str(tmp / "orphan")
    proc = start_cli(slow_job(tmp, "orphan"), home, str(tmp / "cli.log"))
    try:
        pids = wait_running(job_dir)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert all(pid_running(p) for p in pids)  # the job goes on without its client
        st = cli(home, "status", "orphan")
        assert st.returncode == 0 and "master running" in st.stdout, st.stdout + st.stderr
        assert all(f"worker-{i}" in st.stdout for i in range(3))
        stopped = cli(home, "stop", "orphan")
        assert stopped.returncode == 0 and "master" in stopped.stdout
        wait_for(lambda: not any(pid_running(p) for p in pids), 30, "every process gone")
        after = cli(home, "status", "orphan")
        assert "master not running" in after.stdout and " running   pid" not in after.stdout
    finally:
        kill_job_tree(proc, job_dir)


def test_sigterm_stops_a_local_job_in_the_client(toy_checkpoint):  # noqa: F811
    """--distribution_strategy=Local trains in the client's process: SIGTERM ends it
    there (exit 143, the report names the interruption)."""
    tmp = toy_checkpoint
    home, out = str(tmp / "home"), tmp / "local-term"
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.linear.custom_model",
            f"--training_data={tmp / 'predict'}", f"--output={out}", "--job_name=localterm",
            "--minibatch_size=10", "--num_minibatches_per_task=2",
            "--envs=TOY_FEED_DELAY_S=0.2"]
    proc = start_cli(args, home, str(tmp / "cli.log"), TOY_FEED_DELAY_S="0.2")
    try:
        wait_for(lambda: "first task" in (tmp / "cli.log").read_text(), 120, "training")
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        report = read_json(str(out / "job_report.json"))
        assert report["status"] == "failed" and "stopped by SIGTERM" in \
            report["failure"]["error"], report["failure"]
        assert "interrupted (SIGTERM)" in (tmp / "cli.log").read_text()
    finally:
        kill_job_tree(proc, str(out))
