"""Chaos campaign through the real CLI: random faults at random times.

Each trial runs digits as a local-cluster job (``--cluster=local``) and, once
training is under way (a random point between 15% and 60% of the records),
injects one fault:

* ``ps`` mode (2 workers, 2 PS, sync, checkpoints every 10 versions): kill -9 of
  a random worker or a random PS;
* ``allreduce`` mode (3 workers): kill -9 of a random worker, or SIGSTOP (a hung
  member, never continued: the framework must exclude and replace it).

A trial passes when the CLI exits 0, the report says ``succeeded``, every
epoch's ``records_completed`` (and ``records_applied`` where the report has it)
equals the dataset size, and the final accuracy is at least ``--min_accuracy``.
Recovery times come from timestamps the traced model module writes
(``benchmarks/chaos_zoo/traced/digits.py``):

* fault -> survivors' next step (allreduce): when a surviving member's steps
  resume, i.e. the end of the first stall among its first steps after the
  fault (see ``resumed_after``: the step in flight at the fault may complete
  just after it); for a PS kill, the first shard update of the relaunched PS;
* kill -> replacement's first task: the first training minibatch fed by a
  worker that did not exist before the fault.

Run: python benchmarks/chaos_campaign.py --trials 20 [--modes ps,allreduce] [--seed 1]
Prints one line per trial and a summary (pass count, percentiles) per mode, and
writes everything to ``--output`` (default out/chaos_campaign.json).

``--combined``: two or three faults per trial, drawn from {worker, PS, master,
exporter}, each job resumed once from a random checkpoint, every record's
training count checked on the exported model (``benchmarks/chaos_combined.py``):
``--combined --ps_trials 30 --allreduce_trials 20``. ``--smoke``: one short
trial (the combined campaign's with ``--combined``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.integration.helpers import kill_job_tree, live_replicas, read_json  # noqa: E402

ZOO = os.path.join(ROOT, "benchmarks", "chaos_zoo")
TRAINING_RECORDS = 1437


def prepare_data(directory: str) -> str:
    if not os.path.isdir(os.path.join(directory, "train")):
        subprocess.run([sys.executable, os.path.join(ROOT, "model_zoo", "digits",
                                                     "prepare_data.py"),
                        f"--output={directory}"], check=True, capture_output=True, timeout=300)
    return directory


def job_flags(mode: str, epochs: int) -> dict[str, Any]:
    if mode == "ps":
        return {"distribution_strategy": "ParameterServerStrategy", "num_workers": 2,
                "num_ps_pods": 2, "grads_to_wait": 2, "checkpoint_steps": 10,
                "num_epochs": epochs}
    return {"distribution_strategy": "AllreduceStrategy", "num_workers": 3,
            "minibatch_size": 32, "collective_timeout_s": 10, "num_epochs": epochs}


def records_fed(trace_dir: str, minibatch_size: int) -> int:
    """Training records fed so far, from the traces (the job report is written
    only every few seconds: too late to place a fault in a short job)."""
    fed = 0
    for path in glob.glob(os.path.join(trace_dir, "*.trace")):
        with open(path) as f:
            fed += sum(1 for line in f if line.endswith(" feed\n"))
    return fed * minibatch_size


def read_traces(trace_dir: str) -> dict[str, list[tuple[float, str]]]:
    traces: dict[str, list[tuple[float, str]]] = {}
    for path in glob.glob(os.path.join(trace_dir, "*.trace")):
        name = os.path.basename(path)[:-len(".trace")].rsplit("-", 2)
        key = "-".join(name[-2:])  # worker-3 / ps-1
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2:
                    traces.setdefault(key, []).append((float(parts[0]), parts[1]))
    return traces


def first_after(events: list[tuple[float, str]], kind: str, t: float) -> Optional[float]:
    return min((ts for ts, ev in events if ev == kind and ts > t), default=None)


def resumed_after(steps: list[float], t: float) -> Optional[float]:
    """When one member's steps resumed after a fault at ``t``: the end of the
    first stall (a gap over 3x its median step interval before the fault, and
    over 0.2 s) among its first steps after the fault, else its first step after
    it. The step in flight at the fault may complete just after it, so "the
    first step" alone would understate a stall; a later pause (a relaunched
    member joining, seconds later) is a different event and is not counted."""
    before = [x for x in steps if t - 10 <= x <= t]
    after = [x for x in steps if x > t][:4]
    if not after:
        return None
    gaps = [b - a for a, b in zip(before, before[1:])]
    long_gap = max(0.2, 3 * statistics.median(gaps)) if gaps else 0.2
    prev = before[-1] if before else t
    for x in after:
        if x - prev > long_gap:
            return x
        prev = x
    return after[0]


def run_trial(mode: str, index: int, data: str, work: str, rng: random.Random,
              epochs: int, timeout_s: float, min_accuracy: float,
              victims: tuple[str, ...] = ("worker", "ps")) -> dict[str, Any]:
    job = f"chaos-{mode}-{index}"
    job_dir = os.path.join(work, job)
    trace_dir = os.path.join(work, job + "-trace")
    os.makedirs(trace_dir, exist_ok=True)
    flags = {"model_zoo": ZOO, "model_def": "traced.digits.custom_model",
             "training_data": f"{data}/train", "validation_data": f"{data}/val",
             "output": job_dir, "job_name": job, "cluster": "local",
             "checkpoint_dir": os.path.join(work, job + "-ckpt"), **job_flags(mode, epochs)}
    if mode != "ps":
        flags.pop("checkpoint_dir")
    env = {**os.environ, "ELASTICDL_HOME": os.path.join(work, "home"),
           "CHAOS_TRACE_DIR": trace_dir, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT}
    log_path = os.path.join(work, job + ".cli.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "elasticdl_client.main", "train",
                                 *[f"--{k}={v}" for k, v in flags.items()]],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    total = TRAINING_RECORDS * epochs
    at = int(total * rng.uniform(0.15, 0.6))
    result: dict[str, Any] = {"mode": mode, "trial": index, "fault_at_records": at}
    try:
        deadline = time.monotonic() + timeout_s
        minibatch = int(flags.get("minibatch_size", 64))
        while records_fed(trace_dir, minibatch) < at and proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError("training never reached the fault point")
            time.sleep(0.1)
        live = {r["replica"]: r["pid"] for r in live_replicas(job_dir)}
        kinds = tuple(f"{v}-" for v in victims if mode == "ps" or v == "worker")
        candidates = sorted(n for n in live if n.startswith(kinds))
        if proc.poll() is not None or not candidates:
            raise RuntimeError("job ended before the fault")
        victim = rng.choice(candidates)
        sig = signal.SIGKILL
        if mode == "allreduce" and rng.random() < 0.5:
            sig = signal.SIGSTOP
        before = set(live)
        t_fault = time.time()
        os.kill(live[victim], sig)
        result.update(victim=victim, signal=sig.name)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        result["exit_code"] = code
    except (TimeoutError, subprocess.TimeoutExpired, RuntimeError) as e:
        result["error"] = str(e)
        code = None
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json")) or {}
    epochs_ok = [e.get("records_completed") == TRAINING_RECORDS and
                 e.get("records_applied", TRAINING_RECORDS) == TRAINING_RECORDS
                 for e in report.get("epochs", [])]
    accuracy = (report.get("final_metrics") or {}).get("accuracy", 0.0)
    result.update(status=report.get("status"), accuracy=accuracy,
                  epochs=[{k: e.get(k) for k in ("records_completed", "records_redone",
                                                  "records_applied") if k in e}
                          for e in report.get("epochs", [])],
                  relaunches=report.get("relaunches", []),
                  failure=(report.get("failure") or {}).get("error"))
    result["passed"] = (code == 0 and report.get("status") == "succeeded" and
                        len(epochs_ok) == epochs and all(epochs_ok) and
                        accuracy >= min_accuracy)
    if "victim" in result:
        traces = read_traces(trace_dir)
        victim = result["victim"]
        if victim.startswith("ps-"):
            t = first_after(traces.get(victim, []), "step", t_fault)
            result["survivor_next_step_s"] = None if t is None else t - t_fault
        elif mode == "allreduce":
            resumed = [resumed_after(sorted(ts for ts, kind in ev if kind == "step"), t_fault)
                       for name, ev in traces.items()
                       if name.startswith("worker-") and name != victim and name in before]
            resumed = [t for t in resumed if t is not None]
            result["survivor_next_step_s"] = min(resumed) - t_fault if resumed else None
        result["traces"] = {name: [round(ts - t_fault, 4) for ts, kind in ev if kind == "step"]
                            for name, ev in traces.items()}  # seconds from the fault
        new = [first_after(ev, "feed", t_fault) for name, ev in traces.items()
               if name.startswith("worker-") and name not in before]
        new = [t for t in new if t is not None]
        result["replacement_first_task_s"] = min(new) - t_fault if new else None
    if not result["passed"]:
        result["cli_log_tail"] = open(log_path, errors="replace").read()[-2000:]
    return result


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)
    return {"n": len(v), "p50": round(statistics.median(v), 3),
            "p90": round(v[min(len(v) - 1, int(0.9 * len(v)))], 3), "max": round(v[-1], 3)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=4, help="trials per mode")
    p.add_argument("--modes", default="ps,allreduce")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--victims", default="worker,ps", help="replica kinds to fault")
    p.add_argument("--timeout_s", type=float, default=400)
    p.add_argument("--min_accuracy", type=float, default=0.9)
    p.add_argument("--data", default=os.path.join(ROOT, "data", "digits"))
    p.add_argument("--output", default=os.path.join(ROOT, "out", "chaos_campaign.json"))
    p.add_argument("--combined", action="store_true",
                   help="faults in combination on the record-counting job (issue 21)")
    p.add_argument("--ps_trials", type=int, default=30)
    p.add_argument("--allreduce_trials", type=int, default=20)
    p.add_argument("--records", type=int, default=512, help="--combined: dataset size")
    p.add_argument("--faults", type=int, default=0,
                   help="--combined: faults per trial (0: 2 or 3 at random)")
    p.add_argument("--delay_s", type=float, default=0.02,
                   help="--combined: per-minibatch delay of the first run (paces faults)")
    p.add_argument("--smoke", action="store_true", help="one short trial")
    a = p.parse_args(argv)
    if a.combined:
        from benchmarks.chaos_combined import campaign

        if a.smoke:
            a.ps_trials, a.allreduce_trials, a.records, a.faults = 1, 0, 256, 2
        return campaign(a.ps_trials, a.allreduce_trials, a.seed, 2, a.records, a.timeout_s,
                        a.delay_s, a.output, a.faults)
    if a.smoke:
        a.trials, a.modes, a.epochs = 1, "ps", 1
    rng = random.Random(a.seed)
    data = prepare_data(a.data)
    results: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="chaos-") as work:
        for mode in a.modes.split(","):
            for i in range(a.trials):
                t0 = time.monotonic()
                r = run_trial(mode, i, data, work, rng, a.epochs, a.timeout_s,
                              a.min_accuracy, tuple(a.victims.split(",")))
                r["wall_s"] = round(time.monotonic() - t0, 1)
                results.append(r)
                print(f"{mode:9s} trial {i:2d}: {'PASS' if r['passed'] else 'FAIL'} "
                      f"{r.get('signal', '-')} {r.get('victim', '-'):9s} "
                      f"acc {r['accuracy']:.3f} next step "
                      f"{r.get('survivor_next_step_s')} replacement first task "
                      f"{r.get('replacement_first_task_s')} ({r['wall_s']} s)"
                      + ("" if r["passed"] else f" failure: {r.get('failure') or r.get('error')}"),
                      flush=True)
            mine = [r for r in results if r["mode"] == mode]
            summary[mode] = {"passed": sum(r["passed"] for r in mine), "trials": len(mine)}
            # by fault: a killed worker, a stopped (hung) worker, a killed PS
            for label, keep in (("worker_kill", lambda r: r.get("signal") == "SIGKILL" and
                                 r.get("victim", "").startswith("worker-")),
                                ("worker_sigstop", lambda r: r.get("signal") == "SIGSTOP"),
                                ("ps_kill", lambda r: r.get("victim", "").startswith("ps-"))):
                group = [r for r in mine if keep(r)]
                if not group:
                    continue
                summary[mode][label] = {
                    "trials": len(group), "passed": sum(r["passed"] for r in group),
                    "survivor_next_step_s": percentiles(
                        [r["survivor_next_step_s"] for r in group
                         if r.get("survivor_next_step_s") is not None]),
                    "replacement_first_task_s": percentiles(
                        [r["replacement_first_task_s"] for r in group
                         if r.get("replacement_first_task_s") is not None])}
            print(f"{mode}: {json.dumps(summary[mode])}", flush=True)
    os.makedirs(os.path.dirname(a.output), exist_ok=True)
    with open(a.output, "w") as f:
        json.dump({"summary": summary, "trials": results}, f, indent=1)
    return 0 if all(s["passed"] == s["trials"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
