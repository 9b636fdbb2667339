"""Master failover time: kill -9 the master of a running local PS job (digits)
and time until the relaunched master acknowledges the next completed task (the
first task result in its journal). Five kills in one job; prints each figure
and the median, and the downtime each restart's report entry shows.

Run: python benchmarks/master_failover.py [--kills 5] [--workdir DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.integration.helpers import journal_records, task_events, wait_for  # noqa: E402


def reports_after(job_dir: str, seq: int) -> list[dict]:
    """Task results the master acknowledged after journal record ``seq``."""
    return [r for r in task_events(job_dir, seq) if r["op"] == "report"]


def last_seq(job_dir: str) -> int:
    return max((r["seq"] for r in journal_records(job_dir, 0)), default=0)


def master_pid(job_dir: str) -> int:
    try:
        with open(os.path.join(job_dir, "master.json")) as f:
            return int(json.load(f)["pid"])
    except (OSError, ValueError, KeyError):
        return -1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--smoke", action="store_true", help="one kill")
    a = ap.parse_args()
    if a.smoke:
        a.kills = 1
    work = a.workdir or tempfile.mkdtemp(prefix="failover-bench-")
    if a.smoke and not a.workdir:
        atexit.register(shutil.rmtree, work, True)
    data, job_dir = os.path.join(work, "digits"), os.path.join(work, "job")
    subprocess.run([sys.executable, os.path.join(ROOT, "model_zoo", "digits",
                                                 "prepare_data.py"), f"--output={data}"],
                   check=True, capture_output=True, timeout=120)
    env = {**os.environ, "ELASTICDL_HOME": os.path.join(work, "home"), "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "elasticdl_client.main", "train",
           f"--model_zoo={os.path.join(ROOT, 'model_zoo')}",
           "--model_def=digits.digits_cnn.custom_model", f"--training_data={data}/train",
           f"--output={job_dir}", "--job_name=failover-bench", "--cluster=local",
           "--distribution_strategy=ParameterServerStrategy", "--num_workers=2",
           "--num_ps_pods=1", "--num_epochs=30", "--minibatch_size=32",
           "--num_minibatches_per_task=1", f"--max_master_restarts={a.kills}"]
    log = open(os.path.join(work, "cli.log"), "wb")
    cli = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                           start_new_session=True)
    figures = []
    try:
        for k in range(a.kills):
            start = last_seq(job_dir)
            wait_for(lambda s=start: reports_after(job_dir, s + 10), 300, "training under way",
                     interval_s=0.005)
            pid = master_pid(job_dir)
            seq = last_seq(job_dir)
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            wait_for(lambda s=seq: reports_after(job_dir, s), 300, "the next completed task",
                     interval_s=0.005)
            figures.append(time.monotonic() - t0)
            print(f"kill {k + 1}: next task acknowledged {figures[-1]:.2f} s after kill -9",
                  flush=True)
    finally:
        subprocess.run([sys.executable, "-m", "elasticdl_client.main", "stop", "failover-bench"],
                       env=env, capture_output=True, timeout=120)
        try:
            cli.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(cli.pid, signal.SIGKILL)
    with open(os.path.join(job_dir, "job_report.json")) as f:
        report = json.load(f)
    downtimes = [r["downtime_s"] for r in report.get("master_restarts", [])]
    print(f"median of {len(figures)}: {statistics.median(figures):.2f} s from kill -9 to the "
          f"next completed task (report downtime_s: {downtimes})")


if __name__ == "__main__":
    main()
