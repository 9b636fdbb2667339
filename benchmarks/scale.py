"""Bookkeeping at scale: do the master's per-operation costs, snapshots and
restores stay flat as a job's history grows? (issue 20, docs/scale.md)

Each *section* runs one part of the system at several sizes (tasks done), each
size in a fresh child process (so its resident memory is that size's alone),
and reports per-operation figures. ``max_growth_ratio`` is the largest ratio,
over every per-operation figure, between the largest and the smallest size run
(flat: <= 2).

Sections (others add theirs to ``SECTIONS``: a function ``(size, args) ->
dict`` run in the child, and the figure names that must stay flat):

* ``core``: the real :class:`JobCore` with its write-ahead journal, driven
  through the real :class:`MasterServicer` handlers (request validation, proto
  conversion; no network) by ``--workers`` simulated workers that report their
  tasks in random order (so ~``workers`` holes stay open in the closed set), a
  worker dying every 50,000 tasks (its task re-queued), a per-step learning
  rate, and a checkpoint every ``--ckpt_every`` tasks that settles the closed
  tasks the checkpoint before it held (as the PS side does). Snapshots every
  ``--snapshot_every`` tasks (a master at ~4,000 tasks/s snapshots every 5 s).
  Figures at the end: get_task / report_task_result median and p99 (last
  window), snapshot time, size and longest hold of the core's lock, restore
  time (snapshot + the records journaled after it, replayed; the restored
  state must equal the live one), resident memory.

The journal runs with ``fsync=False`` (a disk's fsync is a constant per call,
not what grows; the dispatch benchmark measures it).

Run: python benchmarks/scale.py [--quick | --smoke] [--sizes 1e4,1e5,1e6,1e7]
The last line is one JSON object (max_growth_ratio, snapshot_lock_ms,
master_rss_mib, restore_s, and per size the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def rss_mib() -> float:
    """Resident memory of this process now."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _ms(values: list[float], q: float = 0.5) -> float:
    values = sorted(values)
    return round(1000 * values[min(int(q * len(values)), len(values) - 1)], 4)


class _Context:
    """What the servicer's handlers ask of a gRPC context (no network here)."""

    def invocation_metadata(self) -> tuple:
        return ()

    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")


# ------------------------------------------------------------------- core
def core_section(size: int, args: argparse.Namespace) -> dict[str, Any]:
    from elasticdl.common.task import TaskType
    from elasticdl.master import task_state
    from elasticdl.master.job import JobCore
    from elasticdl.master.journal import Journal
    from elasticdl.master.servicer import MasterServicer
    from elasticdl.master.task_manager import TaskManager
    from elasticdl.proto import elasticdl_pb2 as pb

    rpt, workers = 64, args.workers
    epoch_tasks = min(size, 1_000_000)
    epochs = -(-size // epoch_tasks) + 1   # the job goes on after the figures are taken

    def build() -> JobCore:
        tm = TaskManager([("data", 0, epoch_tasks * rpt)], records_per_task=rpt,
                         num_epochs=epochs, shuffle=True, seed=1, clock=time.time,
                         first_task_id=1 << 40)
        return JobCore.for_tasks(tm, minibatch_size=rpt)

    jdir = tempfile.mkdtemp(prefix="scale-core-")
    core = build()
    journal = Journal(jdir, fsync=False)
    core.attach_journal(journal)
    servicer, ctx = MasterServicer(core), _Context()
    rng = random.Random(0)
    held: dict[int, int] = {}
    window = min(20_000, max(size // 2, 100))
    gets: list[float] = []
    reports: list[float] = []
    done = version = ckpt = 0
    last_closed = None
    began = time.perf_counter()

    def get(w: int) -> None:
        t0 = time.perf_counter()
        task = servicer.get_task(pb.GetTaskRequest(worker_id=w), ctx)
        if done >= size - window:
            gets.append(time.perf_counter() - t0)
        if task.type == TaskType.TRAINING:
            held[w] = task.task_id

    for w in range(workers):
        get(w)
    final_snapshot_at = max(size - args.after_snapshot, 0)
    snapshot_s: list[float] = []
    while held:
        w = rng.choice(list(held)) if len(held) < workers else rng.randrange(workers)
        task_id = held.pop(w)
        t0 = time.perf_counter()
        servicer.report_task_result(pb.ReportTaskResultRequest(
            task_id=task_id, worker_id=w, model_version=version, loss=0.5,
            learning_rate=0.1 * 0.9999 ** done), ctx)
        if done >= size - window:
            reports.append(time.perf_counter() - t0)
        done += 1
        version += 1
        if done < size:
            get(w)
        if done % 50_000 == 0 and held:      # a worker dies: its task is re-queued
            dead = rng.choice(list(held))
            del held[dead]
            core.recover_tasks(dead)
            get(dead)
        if done % args.ckpt_every == 0:      # a checkpoint; the one before it settles
            if last_closed is not None:
                core.settle(ckpt - 1, last_closed)
            last_closed = core.closed_tasks()[1]
            ckpt += 1
        if done % args.snapshot_every == 0 and done < final_snapshot_at or \
                done == final_snapshot_at:
            t0 = time.perf_counter()
            core.snapshot()
            snapshot_s.append(time.perf_counter() - t0)
        if done >= size:
            break
    run_s = time.perf_counter() - began
    snap_path = os.path.join(jdir, "snapshot.json")
    out: dict[str, Any] = {
        "tasks_done": done, "run_s": round(run_s, 1),
        "get_ms": _ms(gets), "get_p99_ms": _ms(gets, 0.99),
        "report_ms": _ms(reports), "report_p99_ms": _ms(reports, 0.99),
        "snapshot_ms": round(1000 * snapshot_s[-1], 2),
        "snapshot_bytes": os.path.getsize(snap_path),
        "snapshot_lock_ms": round(1000 * core.max_snapshot_lock_s, 3),
        "unsettled": core.tm.unsettled(),
        "closed_intervals": core.tm.completed.num_intervals,
        "journal_records_replayed": journal.records_since_snapshot,
        "master_rss_mib": round(rss_mib(), 1),
    }
    journal.close()
    t0 = time.perf_counter()
    restored = build()
    replayed = restored.restore(Journal(jdir, fsync=False))
    out["restore_s"] = round(time.perf_counter() - t0, 3)
    if task_state.dump(restored.tm) != task_state.dump(core.tm) or replayed == 0 and \
            args.after_snapshot:
        a, b = task_state.dump(restored.tm), task_state.dump(core.tm)
        raise SystemExit("the restored core differs from the live one: " + repr(
            {k: (str(a[k])[:300], str(b[k])[:300]) for k in a if a[k] != b[k]}))
    return out


# ---------------------------------------------------------------- driver
# name -> (function run in the child, figures that must stay flat with size)
SECTIONS: dict[str, tuple[Callable[[int, argparse.Namespace], dict[str, Any]], tuple[str, ...]]]
SECTIONS = {
    "core": (core_section, ("get_ms", "report_ms", "snapshot_ms", "snapshot_bytes",
                            "snapshot_lock_ms", "restore_s")),
}


def run_child(section: str, size: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", section, "--sizes", str(size),
           "--workers", str(args.workers), "--ckpt_every", str(args.ckpt_every),
           "--snapshot_every", str(args.snapshot_every),
           "--after_snapshot", str(args.after_snapshot)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"{section} at {size}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def growth(rows: dict[int, dict[str, Any]], flat: tuple[str, ...]) -> dict[str, float]:
    """Per figure: its value at the largest size over its value at the smallest."""
    lo, hi = rows[min(rows)], rows[max(rows)]
    return {k: round(hi[k] / lo[k], 2) if lo[k] else float("inf") for k in flat if k in lo}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1e4, 1e5, 1e6 (a few minutes)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (seconds; a test runs it)")
    ap.add_argument("--sizes", default="1e4,1e5,1e6,1e7")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--workers", type=int, default=500)
    ap.add_argument("--ckpt_every", type=int, default=5000)
    ap.add_argument("--snapshot_every", type=int, default=20_000)
    ap.add_argument("--after_snapshot", type=int, default=2000,
                    help="tasks done after the last snapshot (replayed by the restore)")
    ap.add_argument("--timeout_s", type=float, default=7200)
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.workers, args.ckpt_every = "2e3,8e3", 50, 500
        args.snapshot_every, args.after_snapshot = 1000, 200
    elif args.quick:
        args.sizes = "1e4,1e5,1e6"
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    if args.child:
        print(json.dumps(SECTIONS[args.child][0](sizes[0], args)))
        return
    result: dict[str, Any] = {"sizes": sizes, "sections": {}}
    ratios: dict[str, float] = {}
    for name in args.sections.split(","):
        fn, flat = SECTIONS[name]
        rows = {}
        for size in sizes:
            rows[size] = run_child(name, size, args)
            print(f"{name} {size:>10,}: " + ", ".join(f"{k}={v}" for k, v in
                                                      rows[size].items()), flush=True)
        g = growth(rows, flat)
        ratios.update({f"{name}.{k}": v for k, v in g.items()})
        result["sections"][name] = {"rows": {str(k): v for k, v in rows.items()}, "growth": g}
    core = result["sections"].get("core")
    if core:
        top = core["rows"][str(max(sizes))]
        result.update(snapshot_lock_ms=max(r["snapshot_lock_ms"] for r in core["rows"].values()),
                      master_rss_mib=top["master_rss_mib"], restore_s=top["restore_s"],
                      tasks_done=top["tasks_done"])
    result["max_growth_ratio"] = max(ratios.values()) if ratios else None
    result["growth"] = ratios
    print(json.dumps(result))


if __name__ == "__main__":
    main()
