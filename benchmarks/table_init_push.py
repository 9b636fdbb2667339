"""How long the initialising worker takes to push a materialised embedding table's initial
rows to real PS processes (chunked push_model parts), and what it costs the PS in memory.

    python benchmarks/table_init_push.py [--rows=4194304] [--dim=16] [--num_ps=2] [--smoke]

Prints the table size, the wall time of the push, the throughput, the number of messages
per PS and each PS's peak RSS (VmHWM) before and after; checks a sample of rows bitwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elasticdl.common.job_spec import JobSpec  # noqa: E402
from elasticdl.common.tables import TableSpec  # noqa: E402
from elasticdl.worker.ps_client import PSClient  # noqa: E402
from elasticdl.worker.ps_model_push import model_messages, push_model  # noqa: E402
from tests.conftest import FIXTURE_ZOO  # noqa: E402
from tests.integration.ps_procs import PSProcess  # noqa: E402


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1 << 22)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--num_ps", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="seconds: a 4096 x 4 table, 1 PS")
    a = p.parse_args()
    if a.smoke:
        a.rows, a.dim, a.num_ps = 4096, 4, 1
    job = JobSpec(model_zoo=FIXTURE_ZOO, model_def="toy.ctr.custom_model", training_data="x",
                  distribution_strategy="ParameterServerStrategy", num_ps_pods=a.num_ps)
    torch.manual_seed(0)
    weight = torch.nn.init.xavier_uniform_(torch.empty(a.rows, a.dim))
    spec = TableSpec(name="emb.weight", num_embeddings=a.rows, dim=a.dim, explicit=True)
    parts = sum(1 for _ in model_messages(0, {}, {}, [spec], {"emb.weight": weight}, 0, a.num_ps))
    with tempfile.TemporaryDirectory() as tmp:
        procs = [PSProcess(i, a.num_ps, job, log_path=os.path.join(tmp, f"ps-{i}.log"))
                 for i in range(a.num_ps)]
        client = PSClient([pr.addr for pr in procs], rpc_timeout_s=300)
        try:
            before = [peak_rss_mb(pr.proc.pid) for pr in procs]
            start = time.perf_counter()
            took = push_model(client, 0, {}, {}, [spec], {"emb.weight": weight})
            wall = time.perf_counter() - start
            after = [peak_rss_mb(pr.proc.pid) for pr in procs]
            sample = min(100_000, a.rows)  # a small table: every row
            ids = np.random.default_rng(0).choice(a.rows, sample, replace=False)
            got = client.pull_embedding_unique("emb.weight", np.sort(ids), a.dim,
                                               torch.float32, create=False)
            exact = torch.equal(got, weight[np.sort(ids)])
        finally:
            client.close()
            for pr in procs:
                pr.kill()
    mb = weight.numel() * 4 / 2**20
    print(f"table {a.rows} x {a.dim} float32 = {mb:.0f} MiB to {a.num_ps} PS: taken {took}, "
          f"{wall:.2f} s ({mb / wall:.0f} MiB/s), ~{parts} push_model messages per PS, "
          f"{sample} sampled rows bitwise equal: {exact}")
    print("PS peak RSS MiB before -> after: " +
          ", ".join(f"ps-{i} {b:.0f} -> {c:.0f}" for i, (b, c) in enumerate(zip(before, after))))


if __name__ == "__main__":
    main()
