"""Cost of issue 15's training features, each against a baseline run side by side.

Baseline and candidate take turns step by step (the Local parts run the two
loops in two threads passing a baton, :class:`Lockstep`; the PS part alternates
two trainers in one loop), so each candidate step sits next to a baseline step
under the same load from other processes; the one going first alternates per
round. Reported: per round the median step time of each, and the median of the
per-round ratios.

``--part local``: a Local job of the pytorch/examples MNIST recipe
  (``model_zoo/mnist/mnist_example.py``: Adadelta, StepLR per epoch) with
  ``--clip_grad_norm=1.0`` through everything a Local job does per step (task
  manager, reader, feed, trainer, progress, TensorBoard writer) vs a plain
  PyTorch loop doing the same (Adadelta, StepLR, ``clip_grad_norm_``) on the same
  data held as tensors (target <= 1.05). ``--clip 0``: both without clipping.
``--part ps``: one worker (this process) and 2 PS (subprocesses) training the
  same recipe, ``clip_grad_norm=1.0`` vs off: two PSTrainers on the same PS.
  Clipping takes every gradient's norm in the autograd hooks that stream the
  push, so the push still overlaps backward; the clip factor goes with the
  push's last message (target <= 1.05).
``--part amp``: ``--amp=bf16`` vs off, Local job, CPU; the same two settings in
  a plain PyTorch loop too, to tell torch's own autocast effect from ours.
``--part auc``: exact ``elasticdl.api.metrics.AUC`` over 1M scores in 100
  evaluation tasks (per task: update per minibatch, state serialised as the
  worker sends it; then every state loaded, merged and computed, as the
  finalize task does) vs ``sklearn.metrics.roc_auc_score`` on the concatenated
  data, rounds alternated. The two values must agree within 1e-6.

Run: python benchmarks/training_features.py [--part local|ps|amp|auc|all] [--rounds 7]
     [--steps 30] [--batch 64] [--threads 1] [--clip 1.0]
     [--auc_records 1000000] [--auc_tasks 100] [--auc_minibatch 1024] [--smoke]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = os.path.join(ROOT, "model_zoo")
MODEL_DEF = "mnist.mnist_example.custom_model"
sys.path[:0] = [ROOT, ZOO]


def rounds_of(rounds: int, measure: Callable[[int], tuple[float, float]],
              names: tuple[str, str], unit: str = "ms/step") -> tuple[float, float, float]:
    """``measure(r) -> (base, cand)`` for ``rounds`` rounds; print each round; return
    (median base, median cand, median of cand/base ratios)."""
    b_all, c_all = [], []
    for r in range(rounds):
        b, c = measure(r)
        b_all.append(b)
        c_all.append(c)
        print(f"  round {r}: {names[0]} {b * 1e3:.2f} {unit}, {names[1]} {c * 1e3:.2f} {unit}, "
              f"ratio {c / b:.3f}", flush=True)
    ratio = statistics.median(c / b for b, c in zip(b_all, c_all))
    return statistics.median(b_all), statistics.median(c_all), ratio


def alternate(rounds: int, base: Callable[[int], float], cand: Callable[[int], float],
              names: tuple[str, str], unit: str = "ms/step") -> tuple[float, float, float]:
    """Run ``base(r)`` and ``cand(r)`` ``rounds`` times, order swapped each round."""
    def measure(r: int) -> tuple[float, float]:
        if r % 2:
            c = cand(r)
            return base(r), c
        b = base(r)
        return b, cand(r)

    return rounds_of(rounds, measure, names, unit)


# ------------------------------------------------------------------ Local: data and loops
class Lockstep:
    """Two training loops in two threads taking turns step by step, so that each of
    a candidate's steps sits next to a baseline step under the same machine load.

    Each loop calls :meth:`tick` after every step; the step's time is from the
    moment the loop got its turn to that call. The other loop is blocked on an
    event meanwhile (one runs at a time). :meth:`tick` raises ``StopIteration``
    once the loop has made ``steps`` steps (plus ``warmup`` not counted)."""

    def __init__(self, steps: int, warmup: int = 2, timeout_s: float = 600.0):
        self.steps, self.warmup, self.timeout_s = steps, warmup, timeout_s
        self.turn = [threading.Event(), threading.Event()]
        self.times: list[list[float]] = [[], []]
        self.resumed = [0.0, 0.0]
        self.finished = [False, False]

    def begin(self, i: int) -> None:
        if not self.turn[i].wait(self.timeout_s):
            raise TimeoutError(f"loop {i} never got its turn")
        self.resumed[i] = time.perf_counter()

    def tick(self, i: int) -> None:
        self.times[i].append(time.perf_counter() - self.resumed[i])
        done = len(self.times[i]) >= self.steps + self.warmup
        other = 1 - i
        if not self.finished[other]:
            self.turn[i].clear()
            self.turn[other].set()
            if not done:
                self.begin(i)
        if done:
            self.finished[i] = True
            raise StopIteration
        self.resumed[i] = time.perf_counter()

    def run(self, loops: tuple[Callable[[Callable[[], None]], None],
                               Callable[[Callable[[], None]], None]],
            first: int, threads: int) -> tuple[float, float]:
        """Run ``loops[k](tick)`` side by side, ``loops[first]`` first; the median
        step time of each (warm-up steps left out)."""
        errors: list[BaseException] = []

        def body(k: int) -> None:
            torch.set_num_threads(threads)
            try:
                self.begin(k)
                loops[k](lambda: self.tick(k))
            except StopIteration:
                pass
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors.append(e)
            finally:
                self.finished[k] = True
                self.turn[1 - k].set()

        workers = [threading.Thread(target=body, args=(k,), daemon=True) for k in (0, 1)]
        for w in workers:
            w.start()
        self.turn[first].set()
        for w in workers:
            w.join(self.timeout_s)
            if w.is_alive():
                raise TimeoutError("a benchmark loop did not finish")
        if errors:
            raise errors[0]
        counted = [t[self.warmup:] for t in self.times]
        if min(len(t) for t in counted) < self.steps:
            raise RuntimeError(f"too few steps: {[len(t) for t in counted]}")
        return statistics.median(counted[0]), statistics.median(counted[1])


def make_data(directory: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` MNIST-shaped records in one npz shard; the same data as tensors, standardised
    as the recipe's ``feed`` does."""
    from mnist.mnist_cnn import PIXEL_MEAN, PIXEL_STD

    rng = np.random.default_rng(0)
    x = rng.random((n, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int64)
    os.makedirs(directory, exist_ok=True)
    np.savez(os.path.join(directory, "part-0.npz"), image=x, label=y)
    xt = torch.from_numpy((x - np.float32(PIXEL_MEAN)) / np.float32(PIXEL_STD)).unsqueeze(1)
    return xt, torch.from_numpy(y)


def plain_loop(x: torch.Tensor, y: torch.Tensor, batch: int, clip: float, amp: str,
               tick: Callable[[], None]) -> None:
    """The recipe in plain PyTorch, ``tick()`` after every step, until it raises."""
    import torch.nn.functional as F
    from mnist.mnist_example import Net

    torch.manual_seed(0)
    model = Net()
    model.train()
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    per_epoch = len(x) // batch
    i = 0
    while True:
        s = (i % per_epoch) * batch
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
            loss = F.nll_loss(model(x[s:s + batch]), y[s:s + batch])
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        i += 1
        if i % per_epoch == 0:
            sched.step()
        float(loss.detach())  # the framework reads the loss for its progress line too
        tick()


def local_job_loop(data_dir: str, out_dir: str, batch: int, clip: float, amp: str,
                   tick: Callable[[], None]) -> None:
    """A Local job of the recipe (every per-step hook of the job included), ``tick()``
    after every step, until it raises."""
    from elasticdl.common.job_spec import job_spec_from_flags
    from elasticdl.local.job import LocalJob

    spec = job_spec_from_flags("train", {
        "model_zoo": ZOO, "model_def": MODEL_DEF, "training_data": data_dir,
        "minibatch_size": batch, "num_minibatches_per_task": 8, "output": out_dir,
        "job_name": "bench", "log_level": "WARNING", "clip_grad_norm": clip, "amp": amp,
        "num_epochs": 1000})
    job = LocalJob(spec)
    original = job._after_train_step

    def hook(task: Any, done: int, loss: torch.Tensor) -> None:
        original(task, done, loss)
        tick()

    job._after_train_step = hook  # type: ignore[method-assign]
    job.run()
    raise RuntimeError("the Local job ended before the benchmark's steps")


def side_by_side(a: argparse.Namespace, loops: tuple[Any, Any],
                 names: tuple[str, str]) -> tuple[float, float, float]:
    """Rounds of :class:`Lockstep` runs of ``loops`` (baseline, candidate), the one
    going first alternated; (median baseline, median candidate, median ratio)."""
    return rounds_of(a.rounds, lambda r: Lockstep(a.steps).run(
        (lambda t: loops[0](r, t), lambda t: loops[1](r, t)), r % 2, a.threads), names)


def part_local(a: argparse.Namespace, tmp: str) -> None:
    data = os.path.join(tmp, "data")
    x, y = make_data(data, a.batch * 40)
    print(f"[local] MNIST recipe + clip_grad_norm={a.clip}, batch {a.batch}, {a.steps} steps "
          f"each per round in lockstep, {a.threads} thread(s)")
    b, c, r = side_by_side(a, (
        lambda i, t: plain_loop(x, y, a.batch, a.clip, "off", t),
        lambda i, t: local_job_loop(data, os.path.join(tmp, f"local{i}"), a.batch, a.clip,
                                    "off", t)), ("plain", "Local"))
    print(f"[local] median: plain {b * 1e3:.2f} ms/step, elasticdl Local {c * 1e3:.2f} "
          f"ms/step; median per-round ratio {r:.3f}x (target <= 1.05x)", flush=True)


def part_amp(a: argparse.Namespace, tmp: str) -> None:
    data = os.path.join(tmp, "data")
    x, y = make_data(data, a.batch * 40)
    print(f"[amp] MNIST recipe, Local job, --amp=bf16 vs off on CPU, batch {a.batch}, "
          f"{a.threads} thread(s)")
    b, c, r = side_by_side(a, (
        lambda i, t: local_job_loop(data, os.path.join(tmp, f"off{i}"), a.batch, 0.0, "off",
                                    t),
        lambda i, t: local_job_loop(data, os.path.join(tmp, f"bf16{i}"), a.batch, 0.0,
                                    "bf16", t)), ("off", "bf16"))
    print(f"[amp] Local median: off {b * 1e3:.2f} ms/step, bf16 {c * 1e3:.2f} ms/step; "
          f"median per-round ratio {r:.3f}x", flush=True)
    b, c, r = side_by_side(a, (lambda i, t: plain_loop(x, y, a.batch, 0.0, "off", t),
                               lambda i, t: plain_loop(x, y, a.batch, 0.0, "bf16", t)),
                           ("off", "bf16"))
    print(f"[amp] plain PyTorch median: off {b * 1e3:.2f} ms/step, bf16 autocast "
          f"{c * 1e3:.2f} ms/step; median per-round ratio {r:.3f}x", flush=True)


# ------------------------------------------------------------------ PS
def ps_server(ps_id: int, num_ps: int, batch: int, port_q: Any) -> None:
    sys.path[:0] = [ROOT, ZOO]
    torch.set_num_threads(1)
    from elasticdl.api.model_spec import load_model_spec
    from elasticdl.common.malloc import tune_malloc
    from elasticdl.ps.server import start_server
    from elasticdl.ps.servicer import PServicer
    from elasticdl.ps.shard import PSShard, ShardConfig

    tune_malloc()
    shard = PSShard(ShardConfig(ps_id=ps_id, num_ps=num_ps, grads_to_wait=1,
                                minibatch_size=batch), load_model_spec(ZOO, MODEL_DEF))
    server, port = start_server(PServicer(shard), 0, "127.0.0.1")
    port_q.put((ps_id, port))
    server.wait_for_termination(timeout=3600)


def part_ps(a: argparse.Namespace, tmp: str) -> None:
    from elasticdl.api.model_spec import load_model_spec
    from elasticdl.common.job_spec import JobSpec
    from elasticdl.worker.ps_trainer import PSTrainer

    num_ps = 2
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    procs = [ctx.Process(target=ps_server, args=(i, num_ps, a.batch, port_q), daemon=True)
             for i in range(num_ps)]
    for p in procs:
        p.start()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # three processes on the machine's cores
    try:
        ports = dict(port_q.get(timeout=120) for _ in procs)
        addrs = [f"127.0.0.1:{ports[i]}" for i in range(num_ps)]
        spec = load_model_spec(ZOO, MODEL_DEF)
        trainers = {}
        for wid, clip in enumerate((0.0, 1.0)):
            job = JobSpec(model_zoo=ZOO, model_def=MODEL_DEF, training_data="unused",
                          distribution_strategy="ParameterServerStrategy", num_workers=1,
                          num_ps_pods=num_ps, grads_to_wait=1, minibatch_size=a.batch,
                          clip_grad_norm=clip)
            trainers[clip] = PSTrainer(spec, addrs, job, wid, torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randn(a.batch, 1, 28, 28, generator=g),
                    torch.randint(0, 10, (a.batch,), generator=g)) for _ in range(8)]
        task_ids = {0.0: 1, 1.0: 1_000_001}

        def step(clip: float, k: int) -> float:
            features, labels = batches[k % len(batches)]
            task_ids[clip] += 1
            start = time.perf_counter()
            trainers[clip].set_position(task_ids[clip], 1, a.batch)
            trainers[clip].train_minibatch(features, labels)
            return time.perf_counter() - start

        print(f"[ps] MNIST recipe, 1 worker (this process) + {num_ps} PS (subprocesses), "
              f"sync, batch {a.batch}, {a.steps} steps of each per round, taking turns "
              f"step by step; 1 thread per process; PS streamed during backward: "
              f"{trainers[0.0].streaming}")
        b_all, c_all = [], []
        for r in range(a.rounds):
            times: dict[float, list[float]] = {0.0: [], 1.0: []}
            order = (0.0, 1.0) if r % 2 == 0 else (1.0, 0.0)
            for k in range(a.steps + 2):
                for clip in order:
                    t = step(clip, k)
                    if k >= 2:  # warm-up
                        times[clip].append(t)
            b_all.append(statistics.median(times[0.0]))
            c_all.append(statistics.median(times[1.0]))
            print(f"  round {r}: no clip {b_all[-1] * 1e3:.2f} ms/step, clip_grad_norm=1.0 "
                  f"{c_all[-1] * 1e3:.2f} ms/step, ratio {c_all[-1] / b_all[-1]:.3f}",
                  flush=True)
        b, c = statistics.median(b_all), statistics.median(c_all)
        r = statistics.median(y / x for x, y in zip(b_all, c_all))
        lrs = {clip: t.last_lr for clip, t in trainers.items()}
        print(f"[ps] median: no clip {b * 1e3:.2f} ms/step, clip {c * 1e3:.2f} ms/step; "
              f"median per-round ratio {r:.3f}x (target <= 1.05x); lr applied {lrs}",
              flush=True)
        for t in trainers.values():
            t.close()
    finally:
        torch.set_num_threads(threads)
        for p in procs:
            p.kill()
            p.join(timeout=10)


# ------------------------------------------------------------------ AUC
def part_auc(a: argparse.Namespace, tmp: str) -> None:
    from sklearn.metrics import roc_auc_score

    from elasticdl.api.metrics import AUC
    from elasticdl.worker.eval_metrics import EvalMetrics

    rng = np.random.default_rng(0)
    n, tasks = a.auc_records, a.auc_tasks
    labels = (rng.random(n) < 0.3).astype(np.int64)
    scores = 1.0 / (1.0 + np.exp(-(rng.normal(size=n) + labels)))  # a model's probabilities
    scores_t = torch.from_numpy(scores.astype(np.float32))  # outputs as a model gives them
    labels_t = torch.from_numpy(labels)
    per_task = n // tasks
    mb = a.auc_minibatch
    value: dict[str, float] = {}

    phases: dict[str, list[float]] = {"update": [], "serialise": [], "merge+compute": []}

    def elasticdl_auc(_: int) -> float:
        start = time.perf_counter()
        blobs = []
        spent = {"update": 0.0, "serialise": 0.0}
        worker = EvalMetrics({"auc": AUC()})
        for t in range(tasks):  # each evaluation task, as a worker runs it
            t0 = time.perf_counter()
            worker.begin_task()
            for s in range(t * per_task, (t + 1) * per_task, mb):
                e = min(s + mb, (t + 1) * per_task)
                worker.update(labels_t[s:e], scores_t[s:e], e - s)
            t1 = time.perf_counter()
            blobs.append(worker.end_task()[1])
            spent["update"] += t1 - t0
            spent["serialise"] += time.perf_counter() - t1
        t2 = time.perf_counter()
        final = EvalMetrics({"auc": AUC()})  # the finalize task: load, merge, compute
        value["elasticdl"] = final.finalize(blobs)[0][1]
        end = time.perf_counter()
        value["blob_bytes"] = sum(len(b) for b in blobs)
        for k, v in spent.items():
            phases[k].append(v)
        phases["merge+compute"].append(end - t2)
        return end - start

    def sklearn_auc(_: int) -> float:
        start = time.perf_counter()
        value["sklearn"] = float(roc_auc_score(labels_t.numpy(), scores_t.numpy()))
        return time.perf_counter() - start

    print(f"[auc] {n:,} scores (float32), {tasks} tasks of {per_task:,}, minibatches of {mb}")
    b, c, r = alternate(a.rounds, sklearn_auc, elasticdl_auc, ("sklearn", "elasticdl"),
                        unit="ms")
    diff = abs(value["elasticdl"] - value["sklearn"])
    print(f"[auc] median: sklearn roc_auc_score {b * 1e3:.1f} ms, elasticdl AUC "
          f"update+serialise+merge+compute {c * 1e3:.1f} ms; median per-round ratio "
          f"{r:.2f}x; AUC {value['elasticdl']:.9f} vs {value['sklearn']:.9f} "
          f"(|diff| {diff:.1e}); states {value['blob_bytes'] / 1e6:.1f} MB", flush=True)
    print("[auc] elasticdl phases (median ms): " + ", ".join(
        f"{k} {statistics.median(v) * 1e3:.1f}" for k, v in phases.items()), flush=True)
    if diff > 1e-6:
        raise SystemExit(f"AUC differs from roc_auc_score by {diff}")


PARTS = {"local": part_local, "ps": part_ps, "amp": part_amp, "auc": part_auc}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=[*PARTS, "all"], default="all")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--auc_records", type=int, default=1_000_000)
    ap.add_argument("--auc_tasks", type=int, default=100)
    ap.add_argument("--auc_minibatch", type=int, default=1024)
    ap.add_argument("--clip", type=float, default=1.0,
                    help="--clip_grad_norm of the local part (0: off, on both sides)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads of the Local runs (1: steadier on a "
                         "loaded machine; the PS part always uses 1 per process)")
    ap.add_argument("--smoke", action="store_true", help="seconds: every part, 1 round of "
                    "1 step (after 2 warm-up steps), AUC over 20k scores")
    a = ap.parse_args()
    if a.smoke:
        a.rounds, a.steps, a.batch = 1, 1, 16
        a.auc_records, a.auc_tasks, a.auc_minibatch = 20_000, 4, 1024
    torch.set_num_threads(a.threads)
    logging.basicConfig(level=logging.WARNING)
    # a Local run ends by raising StopIteration from its step hook; its task
    # manager logs that task as failed: not news here
    logging.getLogger("elasticdl.master.task_manager").addFilter(
        lambda record: "StopIteration" not in record.getMessage())
    parts = list(PARTS) if a.part == "all" else [a.part]
    with tempfile.TemporaryDirectory() as tmp:
        for part in parts:
            PARTS[part](a, tmp)


if __name__ == "__main__":
    main()
