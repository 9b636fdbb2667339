"""Digits CNN step time: ParameterServerStrategy with 2 workers and 1 PS
against torch DDP (gloo) with 2 processes, in the same run (medians).

Both train the model module ``digits.digits_cnn`` (its CNN, loss and Adam) on
minibatches of 64 digits-shaped images, one torch thread per process. A PS
step is: pull the changed dense parameters, forward, backward with the push
leaving as gradients become ready, sync wait for the other worker
(``grads_to_wait=2``). A DDP step is forward, backward (bucketed gloo
all_reduce), optimizer step.

Run: python benchmarks/ps_step.py [--steps 60] [--batch 64]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

ZOO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_zoo")
MODEL_DEF = "digits.digits_cnn.custom_model"


def _batches(n: int, batch: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,),
                                                                      generator=g))
            for _ in range(n)]


def ps_server(port_q) -> None:
    import torch

    from elasticdl.api.model_spec import load_model_spec
    from elasticdl.common.malloc import tune_malloc
    from elasticdl.ps.server import start_server
    from elasticdl.ps.servicer import PServicer
    from elasticdl.ps.shard import PSShard, ShardConfig

    tune_malloc()
    torch.set_num_threads(1)
    spec = load_model_spec(ZOO, MODEL_DEF)
    shard = PSShard(ShardConfig(grads_to_wait=2), spec.optimizer)
    server, port = start_server(PServicer(shard), 0, "127.0.0.1")
    port_q.put(port)
    server.wait_for_termination(timeout=3600)


def ps_worker(rank: int, addr: str, steps: int, batch: int, q) -> None:
    import torch

    from elasticdl.api.model_spec import load_model_spec
    from elasticdl.common.job_spec import JobSpec
    from elasticdl.worker.ps_trainer import PSTrainer

    torch.set_num_threads(1)
    job = JobSpec(model_zoo=ZOO, model_def=MODEL_DEF, training_data="unused",
                  distribution_strategy="ParameterServerStrategy", num_workers=2,
                  grads_to_wait=2)
    trainer = PSTrainer(load_model_spec(ZOO, MODEL_DEF), [addr], job, rank,
                        torch.device("cpu"))
    times = []
    for step, (features, labels) in enumerate(_batches(steps, batch, rank)):
        start = time.perf_counter()
        trainer.set_position(rank + 1, step + 1, batch)  # exactly-once identity, as a task
        trainer.train_minibatch(features, labels)
        times.append(time.perf_counter() - start)
    trainer.close()
    q.put((rank, times))


def ddp_worker(rank: int, port: int, steps: int, batch: int, q) -> None:
    import torch
    import torch.distributed as dist

    from elasticdl.api.model_spec import load_model_spec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    spec = load_model_spec(ZOO, MODEL_DEF)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(spec.build_model())
    opt = spec.optimizer(model.parameters())
    times = []
    for features, labels in _batches(steps, batch, rank):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        spec.loss(labels, model(features)).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    q.put((rank, times))


def _run(ctx, target, args_of, q) -> list[float]:
    procs = [ctx.Process(target=target, args=args_of(r), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(q.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    warm = len(results[0]) // 5  # drop start-up steps
    return results[0][warm:] + results[1][warm:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--smoke", action="store_true", help="seconds: 3 steps per worker")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.batch = 3, 16
    from elasticdl.cluster.process import free_port

    ctx = mp.get_context("spawn")
    q, port_q = ctx.Queue(), ctx.Queue()
    ps = ctx.Process(target=ps_server, args=(port_q,), daemon=True)
    ps.start()
    try:
        addr = f"127.0.0.1:{port_q.get(timeout=60)}"
        ps_times = _run(ctx, ps_worker, lambda r: (r, addr, args.steps, args.batch, q), q)
    finally:
        ps.kill()
        ps.join(timeout=10)
    port = free_port()
    ddp_times = _run(ctx, ddp_worker, lambda r: (r, port, args.steps, args.batch, q), q)
    ps_m, ddp_m = statistics.median(ps_times), statistics.median(ddp_times)
    print(f"digits CNN, batch {args.batch}, {args.steps} steps per worker, cpus={os.cpu_count()}")
    print(f"PS (1 PS, 2 workers, sync)  median step {ps_m * 1e3:7.1f} ms")
    print(f"DDP gloo (2 processes)      median step {ddp_m * 1e3:7.1f} ms")
    print(f"ratio (DDP step / PS step): {ddp_m / ps_m:.2f}x")


if __name__ == "__main__":
    main()
