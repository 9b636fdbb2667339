"""PS memory of a huge, sparsely touched embedding table (target: < 200 MB).

One PS process gets a model with one table of ``--rows`` ids (default 2^31)
of ``--dim`` float32 values; a client pulls ``--touched`` distinct random ids
(creating those rows) in batches, then pushes a gradient for each of them (the
row optimizer's state). The PS process's resident memory (VmRSS) is read from
/proc before the model arrives, after it arrived, and after the rows were
touched. Rows and their id index are lazy, so the growth follows the rows
touched, not the table size (the old direct index took 8 bytes x rows / PS:
16 GiB here before any row existed). A 1000-id table is measured first: the
difference is what the table's size and rows cost (the rest is the fixed
cost of a model's first arrival: optimizer and gRPC machinery).

Run: python benchmarks/ps_memory.py [--rows 2147483648] [--touched 100000] [--dim 8]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ps_embedding import ps_server  # noqa: E402 - one PS process for both benchmarks


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def measure(rows: int, touched: int, dim: int, batch: int = 16384) -> dict[str, float]:
    """RSS of a PS process (MB) before the model, with it, and after touching rows."""
    import numpy as np
    import torch

    from elasticdl.common.tables import TableSpec
    from elasticdl.worker.ps_client import PSClient

    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    ps = ctx.Process(target=ps_server, args=(port_q, "Adam"), daemon=True)
    ps.start()
    client = None
    try:
        client = PSClient([f"127.0.0.1:{port_q.get(timeout=120)}"])
        client.wait_ready(60)
        out = {"before_mb": rss_mb(ps.pid)}
        client.push_model(0, {}, {}, [TableSpec("emb", rows, dim, initializer="normal:0.01")])
        out["model_mb"] = rss_mb(ps.pid)
        ids = np.unique(np.random.default_rng(0).integers(0, rows, size=touched))
        for start in range(0, ids.shape[0], batch):
            part = ids[start:start + batch]
            client.pull_embedding_unique("emb", part, dim)
            grad = torch.full((part.shape[0], dim), 0.1)
            client.push_gradients(0, 0, {}, [("emb", part, grad)]).result()
        out["touched_mb"] = rss_mb(ps.pid)
        out["rows"] = float(ids.shape[0])
        return out
    finally:
        if client is not None:
            client.close()
        ps.kill()
        ps.join(timeout=10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1 << 31)
    p.add_argument("--touched", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="seconds: 100k ids, 1k touched")
    args = p.parse_args()
    if args.smoke:
        args.rows, args.touched = 100_000, 1000
    print(f"{args.dim} float32 per row (Adam row state), 1 PS, cpus={os.cpu_count()}")
    for rows, touched in ((1000, 1000), (args.rows, args.touched)):
        m = measure(rows, touched, args.dim)
        growth = m["touched_mb"] - m["before_mb"]
        print(f"table of {rows:>10} ids, {int(m['rows']):>6} rows touched: PS RSS "
              f"{m['before_mb']:.0f} MB before the model, {m['model_mb']:.0f} MB with it, "
              f"{m['touched_mb']:.0f} MB after: +{growth:.0f} MB (target < 200 MB)")


if __name__ == "__main__":
    main()
