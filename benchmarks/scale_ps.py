"""Bookkeeping sized by the live state: the PS ledger and the allreduce trained set.

The real classes (``PSShard`` with its ``AppliedLedger``, the PS checkpoint
writer and reader, ``TrainedRecords``) after a simulated history of ``S``
pushes (minibatches): tasks of 8 minibatches, 64 tasks in flight, the master
closing every task but those (``settle``) every 256 tasks - what the settle
thread does in a job. The history goes straight into the ledger (the push
path's bookkeeping); the push path itself is measured with real pushes on top.

Per size: per-operation costs (medians) and checkpoint / restore / join times
and sizes. A figure "flat" means within 2x between the smallest and largest
size (``max_growth_ratio``). Side by side, the ledger and trained set as they
were before compaction (``baseline_*``: copies of the old classes) at the sizes
where they finish in reasonable time.

Run:  python benchmarks/scale_ps.py [--smoke | --quick] [--sizes 10000,100000]
Sizes: --smoke 4e3,4e4 (seconds); --quick 1e4,1e5,1e6; default 1e4..1e7.
The last line is one JSON object (``max_growth_ratio``, per-size figures).
benchmarks/scale.py imports :func:`run_ps` and :func:`run_trained`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MB_PER_TASK = 8
LIVE_TASKS = 64
SETTLE_EVERY = 256
BASE = 1 << 40   # a run's task ids start at a large base


def _median_us(fn: Callable[[], Any], reps: int, rounds: int = 5) -> float:
    """The lowest of ``rounds`` medians of ``reps // rounds`` calls (µs): a loaded
    machine's bursts inflate whole rounds, not the steady cost."""
    rounds = max(1, min(rounds, reps))
    per = reps // rounds
    best = float("inf")
    for _ in range(rounds):
        out = []
        for _ in range(per):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        best = min(best, statistics.median(out))
    return best * 1e6


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


# ------------------------------------------------------------------ baselines
class OldLedger:
    """The ledger before compaction (main at 465a5f8): a log of every push."""

    def __init__(self) -> None:
        self._by_task: dict[int, dict[int, int]] = {}
        self._log = array("q")

    def add(self, task_id: int, minibatch: int, records: int, version: int) -> None:
        self._by_task.setdefault(task_id, {})[minibatch] = records
        self._log.extend((task_id, minibatch, records, version))

    def entries(self, task_ids: Any = None) -> Any:
        wanted = None if task_ids is None else set(task_ids)
        log = self._log
        for i in range(0, len(log), 4):
            if wanted is None or log[i] in wanted:
                yield log[i], log[i + 1], log[i + 2], log[i + 3]


# ------------------------------------------------------------------------ PS
def _shard(ckpt: str, init: bool = True) -> Any:
    import torch

    from elasticdl.ps.shard import PSShard, ShardConfig

    cfg = ShardConfig(ps_id=0, num_ps=1, use_async=True, checkpoint_dir=ckpt,
                      minibatch_size=8)
    shard = PSShard(cfg, lambda p: torch.optim.SGD(p, lr=0.1))
    if init:
        shard.initialize(0, {"w": torch.zeros(4)}, {}, [])
    return shard


def _fill(add: Callable[[int, int, int, int], None], settle: Callable[[int], None],
          pushes: int) -> int:
    """``pushes`` pushes of tasks BASE.. in order, settling as the master does;
    returns the number of tasks."""
    tasks = pushes // MB_PER_TASK
    v = 0
    for t in range(tasks):
        task = BASE + t
        for mb in range(1, MB_PER_TASK + 1):
            v += 1
            add(task, mb, 8, v)
        if t % SETTLE_EVERY == SETTLE_EVERY - 1:
            settle(t + 1 - LIVE_TASKS)
    settle(tasks - LIVE_TASKS)   # a settle round: LIVE_TASKS tasks in flight at any size
    return tasks


def measure_ps(pushes: int, baseline: bool) -> dict[str, float]:
    import torch

    from elasticdl.common.intervals import IntervalSet
    from elasticdl.ps import shard_checkpoint as shard_ckpt
    from elasticdl.ps.push import GradientPush
    from elasticdl.ps.servicer import _applied_response

    out: dict[str, float] = {"pushes": pushes}
    with tempfile.TemporaryDirectory() as tmp:
        shard = _shard(os.path.join(tmp, "ckpt"))
        led = shard.ledger
        t0 = time.perf_counter()
        tasks = _fill(led.add, lambda hi: shard.settle(-1, IntervalSet([(BASE, BASE + hi)])),
                      pushes)
        out["fill_s"] = time.perf_counter() - t0
        shard.params.version = pushes
        live_task, closed_task = BASE + tasks - 1, BASE
        out["live_entries"] = len(led)
        out["closed_intervals"] = led.closed.num_intervals
        out["seen_us"] = _median_us(lambda: (led.seen(live_task, 3), led.seen(closed_task, 3)),
                                    2000)
        out["applied_us"] = _median_us(lambda: shard.applied_and_closed([live_task]), 500)
        grad = {"w": torch.ones(4)}
        mb = iter(range(100, 10**9))
        out["push_us"] = _median_us(lambda: shard.push_gradients(GradientPush(
            version=shard.version, dense=grad, task_id=live_task, minibatch=next(mb),
            num_records=8)), 300)
        out["dup_push_us"] = _median_us(lambda: shard.push_gradients(GradientPush(
            version=shard.version, dense=grad, task_id=closed_task, minibatch=1,
            num_records=8)), 300)
        version, entries, closed = shard.applied_and_closed()
        out["rollback_answer_bytes"] = _applied_response(version, entries, closed,
                                                         -1).ByteSize()
        out["rollback_answer_ms"] = _median_us(lambda: _applied_response(
            version, entries, closed, -1), 20) / 1e3
        nxt = iter(range(tasks, 10**12))

        def settle_one() -> None:   # a task finishes: its pushes, then the settle round
            task = BASE + next(nxt)
            for k in range(1, MB_PER_TASK + 1):
                led.add(task, k, 8, 0)
            shard.settle(-1, IntervalSet([(BASE, task + 1 - LIVE_TASKS)]))

        out["settle_us"] = _median_us(settle_one, 200)
        ckpt = os.path.join(tmp, "ckpt")
        paths: list[str] = []
        out["save_ms"] = _median_us(lambda: paths.append(shard_ckpt.save_shard(shard, ckpt)),
                                    3) / 1e3
        vdir = os.path.dirname(paths[-1])
        out["checkpoint_bytes"] = _dir_bytes(vdir)
        restored: list[Any] = []

        def restore() -> None:
            again = _shard(os.path.join(tmp, "other"), init=False)
            shard_ckpt.restore_shard(again, vdir)
            restored.append(again)

        out["restore_ms"] = _median_us(restore, 3) / 1e3
        assert len(restored[-1].ledger) == len(shard.ledger)
    if baseline:
        old = OldLedger()
        _fill(old.add, lambda hi: None, pushes)
        out["baseline_applied_us"] = _median_us(lambda: list(old.entries([BASE])),
                                                max(3, min(200, 10**7 // pushes)))
        rows = torch.tensor(old._log.tolist(), dtype=torch.int64).reshape(-1, 4)
        out["baseline_ledger_bytes"] = rows.numel() * 8
    return out


# ------------------------------------------------------------- trained set
def measure_trained(minibatches: int, baseline: bool) -> dict[str, float]:
    from elasticdl.checkpoint import data_position as dp
    from elasticdl.common.intervals import IntervalSet
    from elasticdl.elastic.trained import TrainedRecords

    world = 4   # members: one identity each per step

    def blocks(trained: TrainedRecords, settle: bool) -> int:
        tasks = minibatches // MB_PER_TASK
        step: list[float] = []
        for t in range(tasks):
            task = BASE + t
            for i in range(MB_PER_TASK):
                step += [float(task >> 32), float(task & 0xFFFFFFFF), float(i), 8.0]
                if len(step) == 4 * world:
                    trained.record(step)
                    step = []
            if settle and t % SETTLE_EVERY == SETTLE_EVERY - 1:
                trained.settle(-1, IntervalSet([(BASE, BASE + t + 1 - LIVE_TASKS)]))
        if settle:
            trained.settle(-1, IntervalSet([(BASE, BASE + tasks - LIVE_TASKS)]))
        return tasks

    out: dict[str, float] = {"minibatches": minibatches}
    trained = TrainedRecords(8)
    t0 = time.perf_counter()
    tasks = blocks(trained, settle=True)
    out["fill_s"] = time.perf_counter() - t0
    out["live_entries"] = len(trained.entries())
    task = BASE + tasks
    block = [float(task >> 32), float(task & 0xFFFFFFFF), 0.0, 8.0] * world
    out["record_us"] = _median_us(lambda: trained.record(block), 2000)
    out["minibatches_of_us"] = _median_us(lambda: trained.minibatches_of(BASE + tasks - 1,
                                                                         MB_PER_TASK), 2000)

    def join(src: TrainedRecords) -> int:
        wire = json.dumps(src.state_dict())
        TrainedRecords(8).load_state_dict(json.loads(wire))
        return len(wire)

    out["join_bytes"] = join(trained)
    out["join_ms"] = _median_us(lambda: join(trained), 5) / 1e3
    with tempfile.TemporaryDirectory() as tmp:
        out["checkpoint_ms"] = _median_us(lambda: dp.write_trained_compact(
            tmp, "group", trained.generation, trained.closed, trained.entries()), 5) / 1e3
        out["checkpoint_bytes"] = os.path.getsize(dp.trained_path(tmp, "group"))
    if baseline:   # no settle: the set as it was, one entry per minibatch of the job
        old = TrainedRecords(8)
        blocks(old, settle=False)
        out["baseline_join_bytes"] = join(old)
        out["baseline_join_ms"] = _median_us(lambda: join(old),
                                             3 if minibatches <= 10**5 else 1) / 1e3
    return out


# ----------------------------------------------------------------- summary
PS_FLAT = ("seen_us", "applied_us", "push_us", "dup_push_us", "rollback_answer_bytes",
           "rollback_answer_ms", "settle_us", "save_ms", "checkpoint_bytes", "restore_ms",
           "live_entries")
TRAINED_FLAT = ("record_us", "minibatches_of_us", "join_bytes", "join_ms", "checkpoint_ms",
                "checkpoint_bytes", "live_entries")


def ps_section(size: int, args: Any = None) -> dict[str, float]:
    """benchmarks/scale.py section: the PS ledger after ``size`` pushes."""
    return measure_ps(size, baseline=size <= 10**6)


def trained_section(size: int, args: Any = None) -> dict[str, float]:
    """benchmarks/scale.py section: the allreduce trained set after ``size`` minibatches."""
    return measure_trained(size, baseline=size <= 10**6)


# what benchmarks/scale.py adds to its SECTIONS (name -> (child function, flat figures))
SECTIONS = {"ps_ledger": (ps_section, PS_FLAT), "trained_set": (trained_section, TRAINED_FLAT)}


def growth(rows: list[dict[str, float]], keys: tuple[str, ...]) -> dict[str, float]:
    """Per figure: value at the largest size / value at the smallest."""
    first, last = rows[0], rows[-1]
    return {k: round(last[k] / first[k], 3) if first[k] else float("inf") for k in keys}


def run_ps(sizes: list[int], baseline_upto: int = 10**6) -> dict[str, Any]:
    rows = []
    for s in sizes:
        row = measure_ps(s, baseline=s <= baseline_upto)
        rows.append(row)
        print(f"ps  {s:>9} pushes: " + ", ".join(f"{k}={v:.4g}" for k, v in row.items()
                                               if k != "pushes"), flush=True)
    return {"rows": rows, "growth": growth(rows, PS_FLAT)}


def run_trained(sizes: list[int], baseline_upto: int = 10**6) -> dict[str, Any]:
    rows = []
    for s in sizes:
        row = measure_trained(s, baseline=s <= baseline_upto)
        rows.append(row)
        print(f"set {s:>9} minibatches: " + ", ".join(f"{k}={v:.4g}" for k, v in row.items()
                                                    if k != "minibatches"), flush=True)
    return {"rows": rows, "growth": growth(rows, TRAINED_FLAT)}


def main(argv: Any = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="4e3 and 4e4: seconds")
    p.add_argument("--quick", action="store_true", help="1e4, 1e5, 1e6")
    p.add_argument("--sizes", default="", help="comma-separated sizes (overrides)")
    a = p.parse_args(argv)
    if a.sizes:
        sizes = [int(float(x)) for x in a.sizes.split(",")]
    elif a.smoke:
        sizes = [4000, 40000]
    elif a.quick:
        sizes = [10**4, 10**5, 10**6]
    else:
        sizes = [10**4, 10**5, 10**6, 10**7]
    least = 2 * MB_PER_TASK * LIVE_TASKS
    if sorted(sizes) != sizes or len(sizes) < 2 or sizes[0] < least:
        p.error(f"--sizes: at least two ascending sizes >= {least}")
    ps = run_ps(sizes)
    trained = run_trained(sizes)
    result = {"sizes": sizes, "ps_ledger": ps, "trained_set": trained,
              "max_growth_ratio": max(list(ps["growth"].values()) +
                                      list(trained["growth"].values()))}
    print(json.dumps(result, separators=(",", ":")))
    return result


if __name__ == "__main__":
    main()
