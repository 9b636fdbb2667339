"""Embedding pull throughput of one PS, in ids per second (target >= 1M ids/s).

One PS process holds a table of ``--rows`` rows of ``--dim`` float32 values.
A worker-side :class:`PSClient` pulls batches of unique random ids (the
trainer deduplicates a minibatch's ids before pulling) and the time of each
pull round trip is measured: ids sent as one int64 tensor, a vectorised slot
lookup and ``index_select`` on the PS, rows back as one tensor. Rows are
created on the first pull ("cold" line: lazy creation with the initializer),
then pulled again ("warm": the steady state). Medians over ``--repeats``.

Run: python benchmarks/ps_embedding.py [--rows 1000000] [--dim 8] [--repeats 9]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time


def ps_server(port_q, optimizer: str = "SGD") -> None:
    """One PS process on 127.0.0.1 (its port goes to ``port_q``); ``optimizer``
    names the ``torch.optim`` class its shard uses (lr 0.1 for SGD, else 0.01)."""
    import torch

    from elasticdl.common.malloc import tune_malloc
    from elasticdl.ps.server import start_server
    from elasticdl.ps.servicer import PServicer
    from elasticdl.ps.shard import PSShard, ShardConfig

    tune_malloc()
    torch.set_num_threads(1)
    lr = 0.1 if optimizer == "SGD" else 0.01
    shard = PSShard(ShardConfig(), lambda p: getattr(torch.optim, optimizer)(p, lr=lr))
    server, port = start_server(PServicer(shard), 0, "127.0.0.1")
    port_q.put(port)
    server.wait_for_termination(timeout=3600)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--batches", default="4096,65536,262144", help="ids per pull")
    p.add_argument("--smoke", action="store_true", help="seconds: 10k rows, 1k ids")
    args = p.parse_args()
    if args.smoke:
        args.rows, args.repeats, args.batches = 10_000, 2, "1000"

    import numpy as np
    import torch

    from elasticdl.common.malloc import tune_malloc
    from elasticdl.common.tables import TableSpec
    from elasticdl.worker.ps_client import PSClient

    tune_malloc()
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    ps = ctx.Process(target=ps_server, args=(port_q,), daemon=True)
    ps.start()
    client = None
    try:
        client = PSClient([f"127.0.0.1:{port_q.get(timeout=60)}"])
        client.wait_ready(30)
        spec = TableSpec("emb", args.rows, args.dim, initializer="normal:0.01")
        client.push_model(0, {}, {}, [spec])
        rng = np.random.default_rng(0)
        sizes = [int(b) for b in args.batches.split(",")]
        print(f"table {args.rows} x {args.dim} float32, 1 PS, cpus={os.cpu_count()}, medians of "
              f"{args.repeats} pulls")
        for size in sizes:
            batches = [np.sort(rng.choice(args.rows, size=min(size, args.rows), replace=False))
                       for _ in range(args.repeats)]
            cold, warm = [], []
            for ids in batches:
                start = time.perf_counter()
                rows = client.pull_embedding_unique("emb", ids, args.dim)
                cold.append(time.perf_counter() - start)
                start = time.perf_counter()
                again = client.pull_embedding_unique("emb", ids, args.dim)
                warm.append(time.perf_counter() - start)
                assert torch.equal(rows, again)
            c, w = statistics.median(cold), statistics.median(warm)
            print(f"  {size:>7} ids/pull: warm {w * 1e3:7.1f} ms = {size / w / 1e6:5.2f} M ids/s"
                  f"   cold (rows created) {c * 1e3:7.1f} ms = {size / c / 1e6:5.2f} M ids/s")
        print("target: >= 1M ids/s per PS (warm)")
    finally:
        if client is not None:
            client.close()
        ps.kill()
        ps.join(timeout=10)


if __name__ == "__main__":
    main()
