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

After the sections, ``--dispatch_workers`` simulated workers (1,000) get and
report tasks over gRPC from a real master with its journal and metrics on
(:func:`master_dispatch.run_dispatch`): tasks per second and get_tasks p99.

Run: python benchmarks/scale.py [--quick | --smoke] [--sizes 1e4,1e5,1e6,1e7]
The last line is one JSON object (max_growth_ratio, snapshot_lock_ms,
master_rss_mib, restore_s, dispatch_tasks_per_s, dispatch_p99_ms, and per size
the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
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
class _Workers:
    """``n`` simulated workers: each holds one task; the next to report is picked at
    random (tasks finish out of order); every 50,000 tasks one dies; a checkpoint
    every ``ckpt_every`` tasks settles the closed set of the checkpoint before."""

    def __init__(self, core: Any, n: int, ckpt_every: int, get: Callable, report: Callable):
        self.core, self.n, self.ckpt_every = core, n, ckpt_every
        self.get_fn, self.report_fn = get, report
        self.rng = random.Random(0)
        self.held: dict[int, int] = {}
        self.done = self.ckpt = 0
        self.last_closed: Any = None

    def fill(self) -> None:
        for w in range(self.n):
            if w not in self.held:
                self.get(w)

    def get(self, w: int) -> None:
        task_id = self.get_fn(w)
        if task_id is not None:
            self.held[w] = task_id

    def step(self) -> None:
        """One task reported and its worker's next one taken."""
        held = self.held
        w = self.rng.choice(list(held)) if len(held) < self.n else self.rng.randrange(self.n)
        self.report_fn(held.pop(w), w, self.done)
        self.done += 1
        self.get(w)
        if self.done % 50_000 == 0 and held:      # a worker dies: its task is re-queued
            dead = self.rng.choice(list(held))
            del held[dead]
            self.core.recover_tasks(dead)
            self.get(dead)
        if self.done % self.ckpt_every == 0:      # a checkpoint; the one before settles
            if self.last_closed is not None:
                self.core.settle(self.ckpt - 1, self.last_closed)
            self.last_closed = self.core.closed_tasks()[1]
            self.ckpt += 1


def core_section(size: int, args: argparse.Namespace) -> dict[str, Any]:
    """The history (all but the last window of tasks) goes through the task
    manager's own calls, unjournaled (the state it leaves is the same; the journal
    only holds what came after the last snapshot; settles and deaths go through
    the core); the measured window goes through the servicer's handlers with the
    journal on."""
    from elasticdl.common.task import TaskType
    from elasticdl.master import task_state
    from elasticdl.master.job import JobCore
    from elasticdl.master.journal import Journal
    from elasticdl.master.servicer import MasterServicer
    from elasticdl.master.task_manager import TaskManager
    from elasticdl.proto import elasticdl_pb2 as pb

    rpt = 64
    epoch_tasks = min(size, 1_000_000)
    epochs = -(-size // epoch_tasks) + 1   # the job goes on after the figures are taken

    def build() -> JobCore:
        tm = TaskManager([("data", 0, epoch_tasks * rpt)], records_per_task=rpt,
                         num_epochs=epochs, shuffle=True, seed=1, clock=time.time,
                         first_task_id=1 << 40)
        return JobCore.for_tasks(tm, minibatch_size=rpt)

    core = build()

    tm = core.tm

    def core_get(w: int) -> Any:     # the history: the task manager's own calls
        task = tm.get(w)
        return task.task_id if task.type == TaskType.TRAINING else None

    def core_report(task_id: int, w: int, k: int) -> None:
        tm.report(task_id, w, True)

    workers = _Workers(core, args.workers, args.ckpt_every, core_get, core_report)
    window = min(args.window, size // 2)
    began = time.perf_counter()
    workers.fill()
    while workers.done < size - window:
        workers.step()
    history_s = time.perf_counter() - began

    # the measured window: servicer handlers, journal on, snapshots
    jdir = tempfile.mkdtemp(prefix="scale-core-")
    journal = Journal(jdir, fsync=False)
    core.attach_journal(journal)
    servicer, ctx = MasterServicer(core), _Context()
    gets: list[float] = []
    reports: list[float] = []

    def rpc_get(w: int) -> Any:
        t0 = time.perf_counter()
        task = servicer.get_task(pb.GetTaskRequest(worker_id=w), ctx)
        gets.append(time.perf_counter() - t0)
        return task.task_id if task.type == TaskType.TRAINING else None

    def rpc_report(task_id: int, w: int, k: int) -> None:
        t0 = time.perf_counter()
        servicer.report_task_result(pb.ReportTaskResultRequest(
            task_id=task_id, worker_id=w, model_version=len(reports), loss=0.5,
            learning_rate=0.1 * 0.9999 ** k), ctx)
        reports.append(time.perf_counter() - t0)

    workers.get_fn, workers.report_fn = rpc_get, rpc_report
    final_snapshot_at = size - min(args.after_snapshot, window // 2)
    snapshot_s: list[float] = []
    snapshot_cpu: list[float] = []
    while workers.done < size:
        workers.step()
        if workers.done % args.snapshot_every == 0 and workers.done < final_snapshot_at or \
                workers.done == final_snapshot_at:
            t0, c0 = time.perf_counter(), time.thread_time()
            core.snapshot()
            snapshot_s.append(time.perf_counter() - t0)
            snapshot_cpu.append(time.thread_time() - c0)
    out: dict[str, Any] = {
        "tasks_done": workers.done, "history_s": round(history_s, 1),
        "get_ms": _ms(gets), "get_p99_ms": _ms(gets, 0.99),
        "report_ms": _ms(reports), "report_p99_ms": _ms(reports, 0.99),
        "snapshot_ms": round(1000 * statistics.median(snapshot_s), 2),
        "snapshot_cpu_ms": round(1000 * statistics.median(snapshot_cpu), 2),
        "snapshot_bytes": os.path.getsize(os.path.join(jdir, "snapshot.json")),
        "snapshot_lock_ms": round(1000 * core.max_snapshot_lock_s, 3),
        "snapshot_lock_cpu_ms": round(1000 * core.max_snapshot_lock_cpu_s, 3),
        "unsettled": core.tm.unsettled(),
        "closed_intervals": core.tm.completed.num_intervals,
        "journal_records_replayed": journal.records_since_snapshot,
        "master_rss_mib": round(rss_mib(), 1),
    }
    journal.close()
    walls, cpus = [], []
    for _ in range(args.restores):
        t0, c0 = time.perf_counter(), time.process_time()
        restored = build()
        replayed = restored.restore(Journal(jdir, fsync=False))
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        if task_state.dump(restored.tm) != task_state.dump(core.tm) or not replayed:
            raise SystemExit("the restored core differs from the live one")
        del restored
    out["restore_s"] = round(statistics.median(walls), 3)
    out["restore_cpu_s"] = round(statistics.median(cpus), 3)
    return out


# ---------------------------------------------------------------- driver
# name -> (function run in the child, figures that must stay flat with size)
SECTIONS: dict[str, tuple[Callable[[int, argparse.Namespace], dict[str, Any]], tuple[str, ...]]]
SECTIONS = {
    "core": (core_section, ("get_ms", "report_ms", "snapshot_cpu_ms", "snapshot_bytes",
                            "snapshot_lock_cpu_ms", "restore_cpu_s")),
}
# the PS ledger and the allreduce trained set: benchmarks/scale_ps.py (also runs alone)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale_ps import SECTIONS as PS_SECTIONS  # noqa: E402

SECTIONS.update(PS_SECTIONS)


def run_child(section: str, size: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", section, "--sizes", str(size),
           "--workers", str(args.workers), "--ckpt_every", str(args.ckpt_every),
           "--snapshot_every", str(args.snapshot_every), "--window", str(args.window),
           "--restores", str(args.restores), "--after_snapshot", str(args.after_snapshot)]
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
    ap.add_argument("--snapshot_every", type=int, default=4000)
    ap.add_argument("--window", type=int, default=20_000,
                    help="tasks measured at the end (servicer calls, journal on)")
    ap.add_argument("--restores", type=int, default=3)
    ap.add_argument("--after_snapshot", type=int, default=2000,
                    help="tasks done after the last snapshot (replayed by the restore)")
    ap.add_argument("--timeout_s", type=float, default=7200)
    ap.add_argument("--dispatch_workers", type=int, default=1000,
                    help="simulated workers of the dispatch measurement (0: skip it)")
    ap.add_argument("--dispatch_task_ms", type=float, default=333.0,
                    help="a task's simulated work (1,000 workers x 333 ms: 3,000 tasks/s)")
    ap.add_argument("--dispatch_lease_s", type=float, default=4.0)
    ap.add_argument("--dispatch_seconds", type=float, default=10.0)
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.workers, args.ckpt_every = "2e3,2e4", 50, 500
        args.snapshot_every, args.after_snapshot, args.window, args.restores = 500, 200, 1000, 1
        args.dispatch_workers, args.dispatch_task_ms, args.dispatch_seconds = 50, 50.0, 2.0
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
        rows = core["rows"].values()
        result.update(snapshot_lock_ms=max(r["snapshot_lock_ms"] for r in rows),
                      snapshot_lock_cpu_ms=max(r["snapshot_lock_cpu_ms"] for r in rows),
                      master_rss_mib=top["master_rss_mib"], restore_s=top["restore_s"],
                      restore_cpu_s=top["restore_cpu_s"], tasks_done=top["tasks_done"])
    result["max_growth_ratio"] = max(ratios.values()) if ratios else None
    result["growth"] = ratios
    if args.dispatch_workers:
        # dispatch at a rate over gRPC (benchmarks/master_dispatch.py has the details)
        from master_dispatch import run_dispatch

        d = run_dispatch(args.dispatch_workers, args.dispatch_seconds,
                         task_ms=args.dispatch_task_ms, lease_s=args.dispatch_lease_s,
                         procs=2 if args.smoke else 4)
        print(f"dispatch: {args.dispatch_workers} workers, tasks of {args.dispatch_task_ms} "
              f"ms: {d['tasks_per_s']:.0f} tasks/s, get_tasks p50 {d['p50_ms']:.1f} ms, p99 "
              f"{d['p99_ms']:.1f} ms, master {d['master_cpu_us_per_task']:.0f} us CPU per "
              f"task, load {d['load']:.1f}", flush=True)
        result.update(dispatch_tasks_per_s=round(d["tasks_per_s"]),
                      dispatch_p99_ms=round(d["p99_ms"], 1), dispatch=d)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
