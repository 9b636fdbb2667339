"""Recovery time after SIGKILL of one of two workers: elastic allreduce vs torchrun.

Both scenarios train the MNIST CNN of model_zoo/mnist (batch 64 per process, Adam,
gloo on 127.0.0.1, one intra-op thread per process) with this same script, which
logs every completed step as ``pid role world restart step time``. Once both
workers have completed ``--warmup`` steps, one worker process gets SIGKILL; the
figure is the time from the kill to the next step completed by the survivors:

* ``elastic`` — two ``AllreduceTrainer`` workers; the rendezvous (the real
  :class:`~elasticdl.master.rendezvous.Rendezvous`) runs in this process, which
  also plays the job controller (removes the dead worker once its exit is seen).
  The survivor notices the broken collective, re-rendezvous, takes over the
  state and continues alone, without restarting; measured to its first step in
  the one-member group.
* ``torchrun`` — ``torchrun --standalone --nnodes=1 --nproc-per-node=2
  --max-restarts=1`` running the same script with DDP. The agent sees the dead
  worker, stops the other one and restarts both; the script resumes from the
  checkpoint rank 0 writes every 10 steps (what an elastic torchrun script must
  do). Measured to the first step completed after the restart. torchrun runs
  with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: in torch 2.13 the agent shares
  one TCPStore across restarts and workers connect to it without a per-attempt
  prefix (``_create_c10d_store`` says "we create a new TCPStore for every
  retry", but the shared store is reused), so a restarted gloo group reads the
  dead attempt's peer addresses and often fails with "connectFullMesh ...
  Connection refused"; the opt-out gives each rendezvous round its own prefix.

With the elastic workers the same run also measures, like the master would act:

* ``relaunch`` — a replacement worker process is started right after the kill
  (what the job controller does): kill -> its first step in the group, and its
  *ready* (imports and model built, ``join`` called) -> first step;
* ``sigstop`` — a separate pair: one worker gets SIGSTOP (hung, no connection
  reset); the rendezvous excludes it once it has been silent for
  ``collective_timeout_s + 2`` (the master's setting): stop -> the survivor's
  next step in a group without it.

Scenarios alternate for ``--trials`` rounds; medians are reported.

Run: python benchmarks/allreduce_recovery.py [--trials 3] [--warmup 20] [--smoke]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = os.path.join(ROOT, "model_zoo")
SCRIPT = os.path.abspath(__file__)


# ------------------------------------------------------------------ workers
def _log(path: str, role: str, world: int, restart: int, step: int) -> None:
    with open(path, "a") as f:
        f.write(f"{os.getpid()} {role} {world} {restart} {step} {time.time():.6f}\n")


def _batch(seed: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.rand(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)


def _worker_args() -> argparse.Namespace:
    """Worker settings travel in the environment (torchrun parses its own flags)."""
    env = os.environ
    return argparse.Namespace(
        worker_id=int(env.get("BENCH_WORKER_ID", "0")), manager=env.get("BENCH_MANAGER", ""),
        log=env["BENCH_LOG"], ckpt=env.get("BENCH_CKPT", ""),
        collective_timeout_s=float(env.get("BENCH_TIMEOUT_S", "10")),
        max_steps=int(env.get("BENCH_MAX_STEPS", "100000")))


def elastic_worker(args: argparse.Namespace) -> None:
    import torch

    from elasticdl.api.model_spec import load_model_spec
    from elasticdl.common.job_spec import JobSpec
    from elasticdl.worker.allreduce_trainer import AllreduceTrainer
    from tests.integration.elastic_harness import FakeComm, connect

    host, port = args.manager.rsplit(":", 1)
    rdzv = connect((host, int(port))).rdzv()
    spec = JobSpec(model_zoo=ZOO, model_def="mnist.mnist_cnn.custom_model", training_data="x",
                   distribution_strategy="AllreduceStrategy", job_name="recovery",
                   num_workers=2, collective_timeout_s=args.collective_timeout_s)
    trainer = AllreduceTrainer(load_model_spec(ZOO, spec.model_def), spec, args.worker_id,
                               torch.device("cpu"), FakeComm(rdzv, args.worker_id), "127.0.0.1")
    x, y = _batch(args.worker_id)
    _log(args.log, "ready", 0, 0, -1)
    for step in range(args.max_steps):
        trainer.train_minibatch(x, y)
        _log(args.log, "elastic", trainer.group.world_size, 0, step)
    trainer.close()


def torchrun_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from mnist.mnist_cnn import CNN, optimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DDP(CNN())
    opt = optimizer(model.parameters())
    start = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    x, y = _batch(rank)
    for step in range(start, start + args.max_steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        _log(args.log, "torchrun", world, restart, step)
        if rank == 0 and step % 10 == 0:
            tmp = args.ckpt + ".tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "step": step + 1}, tmp)
            os.replace(tmp, args.ckpt)
    dist.destroy_process_group()


# ------------------------------------------------------------------- parent
def _read(path: str) -> list[tuple[int, str, int, int, int, float]]:
    rows = []
    try:
        with open(path) as f:
            for line in f:
                p = line.split()
                if len(p) == 6:
                    rows.append((int(p[0]), p[1], int(p[2]), int(p[3]), int(p[4]), float(p[5])))
    except FileNotFoundError:
        pass
    return rows


def _wait(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _env(**bench: Any) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join([ROOT, ZOO]), "OMP_NUM_THREADS": "1",
                "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"})
    env.update({f"BENCH_{k.upper()}": str(v) for k, v in bench.items()})
    return env


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass


def _elastic_pair(tmp: str, args: argparse.Namespace, name: str) -> tuple[Any, Any, str, Any]:
    from elasticdl.master.rendezvous import Rendezvous
    from tests.integration.dist_procs import free_port
    from tests.integration.elastic_harness import MasterStandIn

    rdzv = Rendezvous("127.0.0.1", free_port, settle_s=1.0, checkin_timeout_s=30,
                      initial_workers=2, hung_after_s=args.collective_timeout_s + 2)
    master = MasterStandIn(rdzv)
    log = os.path.join(tmp, f"{name}.log")

    def start(w: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, SCRIPT],
            env=_env(role="elastic-worker", worker_id=w, log=log,
                     manager=f"{master.address[0]}:{master.address[1]}",
                     timeout_s=args.collective_timeout_s),
            start_new_session=True)

    return rdzv, master, log, start


def _first(log: str, pid: int, after: float, world: Optional[int] = None) -> Any:
    return next((r for r in _read(log) if r[0] == pid and r[4] >= 0 and r[5] > after
                 and (world is None or r[2] == world)), None)


def run_elastic(tmp: str, args: argparse.Namespace) -> dict[str, float]:
    rdzv, master, log, start = _elastic_pair(tmp, args, "elastic")
    procs: list[subprocess.Popen] = []
    try:
        procs += [start(0), start(1)]
        _wait(lambda: all(sum(1 for r in _read(log) if r[0] == p.pid) >= args.warmup
                          for p in procs), 120, "both elastic workers to train")
        victim = procs[1]
        killed_at = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)              # the job controller sees the exit...
        rdzv.remove_worker(1)        # ...removes the worker from the rendezvous...
        procs.append(start(2))       # ...and relaunches it
        first = _wait(lambda: _first(log, procs[0].pid, killed_at, world=1), 120,
                      "the survivor's next step")
        joined = _wait(lambda: _first(log, procs[2].pid, killed_at), 180,
                       "the replacement's first step")
        ready = next(r for r in _read(log) if r[0] == procs[2].pid and r[4] == -1)
        return {"elastic": first[5] - killed_at, "relaunch": joined[5] - killed_at,
                "ready_to_join": joined[5] - ready[5]}
    finally:
        _stop(procs)
        master.close()


def run_sigstop(tmp: str, args: argparse.Namespace) -> dict[str, float]:
    rdzv, master, log, start = _elastic_pair(tmp, args, "sigstop")
    procs: list[subprocess.Popen] = []
    try:
        procs += [start(0), start(1)]
        _wait(lambda: all(sum(1 for r in _read(log) if r[0] == p.pid) >= args.warmup
                          for p in procs), 120, "both elastic workers to train")
        stopped_at = time.time()
        os.kill(procs[1].pid, signal.SIGSTOP)
        first = _wait(lambda: _first(log, procs[0].pid, stopped_at, world=1),
                      args.collective_timeout_s + 60, "the survivor's step without it")
        return {"sigstop": first[5] - stopped_at}
    finally:
        _stop(procs)
        master.close()


def run_torchrun(tmp: str, args: argparse.Namespace) -> float:
    log = os.path.join(tmp, "torchrun.log")
    ckpt = os.path.join(tmp, "torchrun.ckpt")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = open(os.path.join(tmp, "torchrun.out"), "wb")
    proc = subprocess.Popen(
        [torchrun, "--standalone", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
         SCRIPT],
        env=dict(_env(role="torchrun-worker", log=log, ckpt=ckpt,
                      timeout_s=args.collective_timeout_s),
                 TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        pids = _wait(lambda: _two_warm(log, args.warmup), 120, "both torchrun workers to train")
        killed_at = time.time()
        os.kill(pids[1], signal.SIGKILL)
        first = _wait(lambda: next((r for r in _read(log) if r[3] == 1 and r[5] > killed_at),
                                   None), 180, "a step after torchrun's restart")
        return first[5] - killed_at
    except TimeoutError:
        out.flush()
        with open(os.path.join(tmp, "torchrun.out"), errors="replace") as f:
            print("torchrun output (tail):\n" + f.read()[-4000:], file=sys.stderr)
        raise
    finally:
        _stop([proc])
        out.close()


def _two_warm(log: str, warmup: int) -> Optional[list[int]]:
    counts: dict[int, int] = {}
    for r in _read(log):
        counts[r[0]] = counts.get(r[0], 0) + 1
    warm = sorted(pid for pid, n in counts.items() if n >= warmup)
    return warm if len(warm) >= 2 else None


def main() -> int:
    role = os.environ.get("BENCH_ROLE", "")
    if role:
        sys.path[:0] = [ROOT, ZOO]
        import torch

        torch.set_num_threads(1)
        (elastic_worker if role == "elastic-worker" else torchrun_worker)(_worker_args())
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--collective_timeout_s", type=float, default=10.0)
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true", help="seconds: one elastic trial only "
                    "(no torchrun, no SIGSTOP), 3 warm-up steps")
    args = ap.parse_args()
    if args.smoke:
        args.trials, args.warmup = 1, 3
    sys.path[:0] = [ROOT, ZOO]
    results: dict[str, list[float]] = {k: [] for k in (
        "elastic", "torchrun", "relaunch", "ready_to_join", "sigstop")}
    what = {"elastic": "SIGKILL -> survivor's next step", "torchrun": "SIGKILL -> next step",
            "relaunch": "SIGKILL -> replacement's first step",
            "ready_to_join": "replacement ready -> its first step",
            "sigstop": "SIGSTOP -> survivor's step without it"}
    for trial in range(args.trials):
        order: list[Any] = [run_elastic] if args.smoke else [run_elastic, run_torchrun,
                                                              run_sigstop]
        if trial % 2:
            order.reverse()
        for fn in order:
            with tempfile.TemporaryDirectory() as tmp:
                got = fn(tmp, args)
            if not isinstance(got, dict):
                got = {"torchrun": got}
            for name, seconds in got.items():
                results[name].append(seconds)
                print(f"trial {trial}: {name:13s} {what[name]:38s} {seconds:6.2f} s", flush=True)
    med = {k: statistics.median(v) if v else float("nan") for k, v in results.items()}
    el, tr = med["elastic"], med["torchrun"]
    summary = {"elastic_s": round(el, 3), "torchrun_s": round(tr, 3),
               "speedup": round(tr / el, 2), "trials": args.trials,
               "relaunch_s": round(med["relaunch"], 3),
               "ready_to_join_s": round(med["ready_to_join"], 3),
               "sigstop_s": round(med["sigstop"], 3),
               "collective_timeout_s": args.collective_timeout_s,
               **{f"{k}_all": [round(v, 3) for v in vs] for k, vs in results.items()}}
    # a scenario not run (--smoke) has no figure: leave it out rather than print NaN
    summary = {k: v for k, v in summary.items() if not (isinstance(v, float) and v != v)}
    if args.smoke:
        print(f"smoke: elastic {el:.2f} s; relaunched worker in the group "
              f"{med['relaunch']:.2f} s after the kill")
    else:
        print(f"median recovery: elastic {el:.2f} s, torchrun --max-restarts {tr:.2f} s "
              f"({tr / el:.1f}x); relaunched worker in the group {med['relaunch']:.2f} s "
              f"after the kill ({med['ready_to_join']:.2f} s after it was ready); SIGSTOP -> "
              f"survivor goes on {med['sigstop']:.2f} s (collective timeout "
              f"{args.collective_timeout_s:g} s)")
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
