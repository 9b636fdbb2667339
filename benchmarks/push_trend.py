"""A long push-bound PS job through the CLI, with a worker and then a PS killed: does
the job slow down as its history grows, and is every record still applied once?

Issue 20 measured this on the old bookkeeping: an async PS job (300k CSV records of 5
floats, a linear model, minibatch 8, 1 PS, 2 workers) ran epoch 0 at 142 s and epoch 2 at
260 s (x1.83), nothing changing but the history. This runs the same kind of job, as a user
does (``elasticdl train --cluster=local``, async ParameterServerStrategy, 1 PS, 2 workers,
minibatch 8, a checkpoint every ``--checkpoint-steps`` versions):

* kill -9 of worker 1 once epoch 1 is a third done, of the PS once epoch 2 is a third
  done and a checkpoint exists (the PS is relaunched and every PS rolls back to it);
* per epoch from the job report: records completed, records applied (read back from the
  PS's ledgers), wall seconds (first task out to last record done) and records/s;
* pushes per PS: the PS's model version at the end (async: one version per push, plus
  the pushes a rollback undid and were made again).

The trend figure is the last epoch's records/s over the first's (1.0: flat; issue 20
wants >= 0.8 with >= 1e5 pushes per PS). Epochs 1 and 2 hold the kills, so with
``--epochs 4`` the compared epochs 0 and 3 hold none. Exits 1 if an epoch's
records_completed or records_applied is not the dataset size (a fast wrong job is no
figure).

Run: python benchmarks/push_trend.py [--records 200000] [--epochs 4] [--no-kills]
     [--workdir DIR] [--smoke]
Prints progress lines, a line per epoch, and the summary as a JSON last line.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from elasticdl.checkpoint.paths import complete_versions  # noqa: E402
from tests.integration.helpers import (  # noqa: E402
    kill_job_tree,
    pid_of,
    read_json,
    records_done,
    start_cli,
    wait_for,
)

FIXTURE_ZOO = os.path.join(ROOT, "tests", "fixtures", "zoo")


def write_csv(path: str, n: int, seed: int = 0) -> None:
    """``n`` lines ``x0,x1,x2,x3,y,id`` (tests/fixtures/zoo/toy/linear.py reads them)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = x @ np.array([0.5, -1.0, 2.0, 0.25], dtype=np.float32) + 0.1
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "data.csv"), "w") as f:
        for i in range(n):
            f.write(",".join(f"{v:.5f}" for v in x[i]) + f",{y[i]:.5f},{i}\n")


def _kill(proc: Any, job_dir: str, replica: str, killed: list[str]) -> None:
    """kill -9 ``replica`` unless the job (or that replica: a worker done with its
    tasks) ended first, which a tiny ``--smoke`` job on a loaded machine can do."""
    pid = wait_for(lambda: proc.poll() is not None or pid_of(job_dir, replica), 60, replica)
    if proc.poll() is not None or pid is True:
        print(f"{replica} not killed: the job ended first", flush=True)
        return
    os.kill(pid, signal.SIGKILL)
    killed.append(f"{replica} at {records_done(job_dir)} records")
    print(f"killed {replica} (pid {pid})", flush=True)


def run(records: int, epochs: int, work: str, kills: bool = True, minibatch: int = 8,
        minibatches_per_task: int = 16, checkpoint_steps: int = 2000,
        timeout_s: float = 3600.0) -> dict[str, Any]:
    """One job; returns the summary (see the module docstring)."""
    data, job_dir, ckpt = (os.path.join(work, d) for d in ("data", "job", "ckpt"))
    write_csv(data, records)
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.linear.custom_model",
            f"--training_data={data}", f"--output={job_dir}", "--job_name=push-trend",
            "--cluster=local", "--distribution_strategy=ParameterServerStrategy",
            "--use_async=true", "--num_ps_pods=1", "--num_workers=2",
            f"--minibatch_size={minibatch}", f"--num_minibatches_per_task={minibatches_per_task}",
            f"--num_epochs={epochs}", f"--checkpoint_dir={ckpt}",
            f"--checkpoint_steps={checkpoint_steps}", "--keep_checkpoint_max=2"]
    started = time.monotonic()
    proc = start_cli(args, os.path.join(work, "home"), os.path.join(work, "cli.log"))
    killed: list[str] = []
    try:
        if kills and epochs >= 3:
            wait_for(lambda: proc.poll() is not None or records_done(job_dir) >= records * 4 / 3,
                     timeout_s, "epoch 1 a third done", interval_s=0.5)
            _kill(proc, job_dir, "worker-1", killed)
            wait_for(lambda: proc.poll() is not None or (
                records_done(job_dir) >= records * 7 / 3 and complete_versions(ckpt)),
                timeout_s, "epoch 2 a third done and a checkpoint", interval_s=0.5)
            _kill(proc, job_dir, "ps-0", killed)
        deadline = time.monotonic() + timeout_s
        last = -1
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the job did not end within {timeout_s:.0f} s")
            done = records_done(job_dir)
            if done // max(1, records // 2) != last:   # a line every half epoch
                last = done // max(1, records // 2)
                el = time.monotonic() - started
                rate = done / el if el > 0 else 0.0
                eta = (records * epochs - done) / rate if rate else float("nan")
                print(f"progress: {done}/{records * epochs} records, {rate:.0f} records/s, "
                      f"ETA {eta:.0f} s", flush=True)
            time.sleep(1.0)
        code = proc.returncode
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json")) or {}
    if code != 0 or report.get("status") != "succeeded":
        with open(os.path.join(work, "cli.log"), errors="replace") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"job ended {report.get('status')} (exit {code}): "
                           f"{report.get('failure')}\n{tail}")
    rows = report["epochs"]
    rates = [e.get("records_per_s", 0.0) for e in rows]
    return {"records": records, "epochs": epochs, "minibatch": minibatch,
            "pushes_per_ps": int(report.get("model_version", 0)), "killed": killed,
            "relaunches": [(r["replica"], r["new_replica"]) for r in report["relaunches"]],
            "per_epoch": rows,
            "exact": all(e["records_completed"] == records == e["records_applied"]
                         for e in rows) and len(rows) == epochs,
            "trend_last_over_first": round(rates[-1] / rates[0], 3) if rates[0] else 0.0,
            "wall_s": round(time.monotonic() - started, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--checkpoint-steps", type=int, default=2000)
    ap.add_argument("--no-kills", action="store_true")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--smoke", action="store_true", help="3,000 records, 3 epochs")
    a = ap.parse_args()
    if a.smoke:
        a.records, a.epochs, a.checkpoint_steps = 3000, 3, 100
    work = a.workdir or tempfile.mkdtemp(prefix="push-trend-")
    if not a.workdir:
        atexit.register(shutil.rmtree, work, True)
    out = run(a.records, a.epochs, work, kills=not a.no_kills,
              checkpoint_steps=a.checkpoint_steps)
    for e in out["per_epoch"]:
        print(f"epoch {e['epoch']}: completed {e['records_completed']}, applied "
              f"{e['records_applied']}, redone {e['records_redone']}, "
              f"{e.get('wall_s', 0):.1f} s, {e.get('records_per_s', 0):.0f} records/s",
              flush=True)
    print(f"pushes per PS {out['pushes_per_ps']}; last/first epoch records/s "
          f"{out['trend_last_over_first']:.3f}; killed {out['killed']}; exact {out['exact']}")
    print(json.dumps(out))
    if not out["exact"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
