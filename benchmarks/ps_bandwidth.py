"""PS dense bandwidth: push + pull of a 40 MB model through one PS, against
``torch.distributed`` gloo ``all_reduce`` of the same bytes between two
processes, measured in the same run (alternating rounds; medians).

One PS step for a worker moves the model's bytes twice (gradients up,
parameters down), as gloo's ring all_reduce between two ranks moves them once
each way per rank. The PS applies SGD to the pushed gradient (the real path:
chunked stream -> decode into place -> optimizer.step -> chunked pull). The
ratio printed is ``gloo time / PS time`` (>= 1: the PS moves the bytes faster).

A third line measures the floor of the transport itself: the same bytes up
and down through gRPC Python as ready-made ``bytes`` messages of the chunk
size, with no (de)serialisation, tensor copies or optimizer (``raw gRPC``).

Run: python benchmarks/ps_bandwidth.py [--mb 40] [--tensors 10] [--repeats 9] [--rounds 3]
     [--chunk_mb 4] [--smoke]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time


def raw_handler(nbytes: int, chunk_bytes: int):
    """``bench.Raw/up`` (consume a stream) and ``/down`` (send nbytes): bytes only."""
    import grpc

    blob = [bytes(chunk_bytes) for _ in range(max(1, nbytes // chunk_bytes))]

    def up(requests, context):
        for _ in requests:
            pass
        return b""

    def down(request, context):
        yield from blob

    return grpc.method_handlers_generic_handler("bench.Raw", {
        "up": grpc.stream_unary_rpc_method_handler(up),
        "down": grpc.unary_stream_rpc_method_handler(down)})


def ps_server(port_q, chunk_bytes: int, nbytes: int) -> None:
    import torch

    from elasticdl.common.malloc import tune_malloc
    from elasticdl.ps.server import start_server
    from elasticdl.ps.servicer import PServicer
    from elasticdl.ps.shard import PSShard, ShardConfig

    tune_malloc()
    torch.set_num_threads(1)
    shard = PSShard(ShardConfig(), lambda p: torch.optim.SGD(p, lr=1e-6))
    server, port = start_server(PServicer(shard, chunk_bytes), 0, "127.0.0.1")
    server.add_generic_rpc_handlers((raw_handler(nbytes, chunk_bytes),))
    port_q.put(port)
    server.wait_for_termination(timeout=3600)


def gloo_rank(rank: int, port: int, numel: int, repeats: int, rounds: int, q, go) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    t = torch.ones(numel)
    for _ in range(2):
        dist.all_reduce(t)
    if rank == 0:
        q.put("ready")
    for _ in range(rounds):
        go.wait()  # the parent alternates PS and gloo rounds
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        if rank == 0:
            q.put(statistics.median(times))
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=40.0)
    p.add_argument("--tensors", type=int, default=10, help="the model's parameter count")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunk_mb", type=float, default=4.0)
    p.add_argument("--smoke", action="store_true", help="seconds: a 1 MB model, 1 round")
    args = p.parse_args()
    if args.smoke:
        args.mb, args.tensors, args.repeats, args.rounds, args.chunk_mb = 1.0, 4, 2, 1, 0.25

    import torch

    from elasticdl.cluster.process import free_port
    from elasticdl.common.malloc import tune_malloc
    from elasticdl.worker.ps_client import PSClient

    tune_malloc()
    torch.set_num_threads(1)
    chunk_bytes = int(args.chunk_mb * (1 << 20))
    numel = int(args.mb * 1e6 / 4)
    per = numel // args.tensors
    model = {f"layer{i}.weight": torch.randn(per) for i in range(args.tensors)}
    nbytes = sum(t.numel() * 4 for t in model.values())
    grads = {n: torch.full_like(t, 1e-3) for n, t in model.items()}

    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    ps = ctx.Process(target=ps_server, args=(port_q, chunk_bytes, nbytes), daemon=True)
    ps.start()
    q, go = ctx.Queue(), ctx.Event()
    gport = free_port()
    ranks = [ctx.Process(target=gloo_rank, args=(r, gport, nbytes // 4, args.repeats,
                                                 args.rounds, q, go), daemon=True)
             for r in range(2)]
    client = None
    try:
        client = PSClient([f"127.0.0.1:{port_q.get(timeout=60)}"], chunk_bytes=chunk_bytes)
        client.wait_ready(30)
        client.push_model(0, model, {}, [])
        for r in ranks:
            r.start()
        assert q.get(timeout=120) == "ready"
        dest = {n: torch.empty_like(t) for n, t in model.items()}
        version = [0]  # the pushed model's; each push carries the version it was computed on

        def step() -> float:
            start = time.perf_counter()
            stream = client.open_push_stream(0, version[0])
            for n, g in grads.items():
                stream.put_dense(n, g)
            _, version[0] = stream.finish()
            res = client.pull_dense([version[0] - 1], dest, [True])
            assert res[0][2], "pull returned nothing"
            return time.perf_counter() - start

        raw_up = client._channels[0].stream_unary("/bench.Raw/up")
        raw_down = client._channels[0].unary_stream("/bench.Raw/down")
        blob = [bytes(chunk_bytes) for _ in range(max(1, nbytes // chunk_bytes))]

        def raw_step() -> float:
            start = time.perf_counter()
            raw_up(iter(blob), timeout=60)
            for _ in raw_down(b"", timeout=60):
                pass
            return time.perf_counter() - start

        for _ in range(2):
            step()
            raw_step()
        ps_medians, gloo_medians, raw_medians = [], [], []
        for _ in range(args.rounds):
            ps_medians.append(statistics.median(step() for _ in range(args.repeats)))
            raw_medians.append(statistics.median(raw_step() for _ in range(args.repeats)))
            go.set()
            gloo_medians.append(q.get(timeout=600))
            go.clear()
            time.sleep(0.2)
        ps_t, gloo_t = statistics.median(ps_medians), statistics.median(gloo_medians)
        raw_t = statistics.median(raw_medians)
        mb = nbytes / 1e6
        print(f"model {mb:.1f} MB in {args.tensors} tensors, chunks of {args.chunk_mb:g} MiB, "
              f"{args.rounds} rounds x {args.repeats} repeats, cpus={os.cpu_count()}")
        print(f"PS push+pull      median {ps_t * 1e3:8.1f} ms  ({2 * mb / ps_t:7.0f} MB/s "
              f"moved, rounds {[round(x * 1e3, 1) for x in ps_medians]})")
        print(f"gloo all_reduce   median {gloo_t * 1e3:8.1f} ms  ({2 * mb / gloo_t:7.0f} MB/s "
              f"moved, rounds {[round(x * 1e3, 1) for x in gloo_medians]})")
        print(f"raw gRPC up+down  median {raw_t * 1e3:8.1f} ms  ({2 * mb / raw_t:7.0f} MB/s "
              f"moved, rounds {[round(x * 1e3, 1) for x in raw_medians]})")
        print(f"ratio (gloo time / PS time): {gloo_t / ps_t:.2f}x  (target >= 0.8x); "
              f"transport floor (gloo / raw gRPC): {gloo_t / raw_t:.2f}x; "
              f"PS / raw gRPC: {ps_t / raw_t:.2f}")
    finally:
        if client is not None:
            client.close()
        for r in ranks:
            r.join(timeout=30)
            if r.is_alive():
                r.kill()
        ps.kill()
        ps.join(timeout=10)


if __name__ == "__main__":
    main()
