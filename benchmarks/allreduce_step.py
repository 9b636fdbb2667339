"""Steady-state step time: AllreduceTrainer vs torch DDP, same script, same processes.

Two processes on 127.0.0.1, gloo, the MNIST CNN of model_zoo/mnist, batch 64 per
process, the model module's optimizer (Adam), one intra-op thread per process
(two processes share the machine's cores). Each process holds both an
AllreduceTrainer (on the default group) and a DDP replica (on a group of its
own) and alternates short blocks of steps of each on the same fixed batch, so
load changes on a shared machine hit both alike. Reported: the median step time
of each on rank 0, their ratio (target <= 1.05) and the median of per-block ratios.

An AllreduceTrainer step is a whole elastic round: the asynchronous meta
all-reduce, forward, backward with bucketed all-reduce from gradient hooks,
optimizer step. Its rendezvous is a static one-plan stand-in (no master).

``--batchnorm``: the same CNN with BatchNorm after each convolution
(``tests/fixtures/zoo/toy/bn_cnn.py``): AllreduceTrainer all-reduces the buffers
with the gradients every step, DDP broadcasts rank 0's buffers before every
forward (its default ``broadcast_buffers=True``) — the cost of buffer sync.

Run: python benchmarks/allreduce_step.py [--blocks 20] [--block_steps 10] [--batchnorm]
     [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = os.path.join(ROOT, "model_zoo")
FIXTURE_ZOO = os.path.join(ROOT, "tests", "fixtures", "zoo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StaticComm:
    """A rendezvous with one fixed plan (a CommClient for AllreduceTrainer)."""

    def __init__(self, rank: int, world: int, port: int):
        from elasticdl.master.rendezvous import CommPlan

        self.plan = CommPlan(1, rank, world, tuple(f"127.0.0.1:{i}" for i in range(world)),
                             "127.0.0.1", port, True)

    def join(self, host: str, port: int) -> Any:
        return self.plan

    def get_comm_plan(self, known_version: int) -> Any:
        return self.plan

    def report_collective_failure(self, plan_version: int, reason: str) -> Any:
        raise RuntimeError(f"collective failed during the benchmark: {reason}")


def _batch(seed: int = 0) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.rand(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)


def worker(rank: int, world: int, port: int, blocks: int, block_steps: int, warmup: int,
           out: Any, batchnorm: bool = False) -> None:
    sys.path[:0] = [ROOT, ZOO]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from mnist.mnist_cnn import CNN, optimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from elasticdl.api.model_spec import load_model_spec
    from elasticdl.common.job_spec import JobSpec
    from elasticdl.worker.allreduce_trainer import AllreduceTrainer

    torch.set_num_threads(1)
    try:
        zoo, model_def = ((FIXTURE_ZOO, "toy.bn_cnn.custom_model") if batchnorm
                          else (ZOO, "mnist.mnist_cnn.custom_model"))
        spec = JobSpec(model_zoo=zoo, model_def=model_def,
                       training_data="x", distribution_strategy="AllreduceStrategy",
                       job_name="bench", num_workers=world, minibatch_size=64)
        # the elastic trainer forms the default group; DDP gets a group of its own
        model_spec = load_model_spec(zoo, spec.model_def)
        trainer = AllreduceTrainer(model_spec, spec, rank,
                                   torch.device("cpu"), StaticComm(rank, world, port),
                                   "127.0.0.1")
        trainer.runner.start()
        ddp_group = dist.new_group(list(range(world)), backend="gloo")
        torch.manual_seed(0)
        ddp = DDP(model_spec.build_model() if batchnorm else CNN(), process_group=ddp_group)
        ddp_opt = optimizer(ddp.parameters())
        x, y = _batch(rank)

        def ddp_step() -> None:
            ddp_opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            ddp_opt.step()

        def elastic_step() -> None:
            trainer.train_minibatch(x, y)

        steps = {"ddp": ddp_step, "elastic": elastic_step}
        times: dict[str, list[float]] = {"ddp": [], "elastic": []}
        for _ in range(warmup):
            ddp_step()
            elastic_step()
        for block in range(blocks):  # alternate short blocks: load drifts hit both alike
            order = ["ddp", "elastic"] if block % 2 == 0 else ["elastic", "ddp"]
            for name in order:
                for _ in range(block_steps):
                    t0 = time.perf_counter()
                    steps[name]()
                    times[name].append(time.perf_counter() - t0)
        if rank == 0:
            out.put(("ok", times))
        trainer.close()
    except BaseException as e:  # reported to the parent, which exits non-zero
        out.put(("error", f"rank {rank}: {e!r}"))
        raise


def run_once(args: Any) -> tuple[str, Any]:
    """One run of ``args.world`` processes on a fresh port: ``("ok", times)``,
    ``("error", message)`` or ``("timeout", None)``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args.world, port, args.blocks,
                                              args.block_steps, args.warmup, out,
                                              args.batchnorm),
                         daemon=True) for r in range(args.world)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=120 + args.blocks * args.block_steps * 2.0)
    except queue.Empty:
        return "timeout", None
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--block_steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--batchnorm", action="store_true",
                    help="CNN with BatchNorm: measures buffer synchronisation")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--smoke", action="store_true", help="seconds: 2 blocks of 2 steps")
    args = ap.parse_args()
    if args.smoke:
        args.blocks, args.block_steps, args.warmup = 2, 2, 1
    for attempt in range(3):
        status, times = run_once(args)
        # the store's port was free when chosen and taken before rank 0 listened on it
        # (another process's connection can get any free port): again, on another port
        if status != "error" or "EADDRINUSE" not in str(times) or attempt == 2:
            break
        print(f"the store's port was taken meanwhile ({times}); again on another port",
              file=sys.stderr)
    if status == "timeout":
        print("benchmark timed out", file=sys.stderr)
        return 1
    if status == "error":
        print(f"worker failed: {times}", file=sys.stderr)
        return 1
    ddp = statistics.median(times["ddp"])
    el = statistics.median(times["elastic"])
    n = args.block_steps
    block_ratios = [statistics.median(times["elastic"][i:i + n]) /
                    statistics.median(times["ddp"][i:i + n])
                    for i in range(0, len(times["ddp"]), n)]
    summary = {"ddp_ms": round(ddp * 1e3, 3), "elastic_ms": round(el * 1e3, 3),
               "ratio": round(el / ddp, 3),
               "median_block_ratio": round(statistics.median(block_ratios), 3),
               "steps_each": len(times["ddp"]), "world": args.world, "batch": 64,
               "threads_per_process": 1, "batchnorm": args.batchnorm}
    print(f"median step over {len(times['ddp'])} steps each: DDP {ddp * 1e3:.2f} ms, "
          f"AllreduceTrainer {el * 1e3:.2f} ms, ratio {el / ddp:.3f} (median of block "
          f"ratios {summary['median_block_ratio']:.3f}; target <= 1.05)")
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
