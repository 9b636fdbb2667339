"""What loader processes that cannot inherit a held lock cost (issue 32).

A worker's DataLoader processes start from a ``forkserver`` (preloading torch), not by
``fork``: a forked child inherits every lock another thread of the worker held at the
fork (gRPC's, the prefetch thread's, logging's) and can block forever. This measures
the price, side by side in one script, on a map-style dataset of ``--records``
records of ``--dim`` floats, ``--workers`` loader processes, minibatches of
``--batch``:

* ``cold_first_batch_s``: the first loader's first batch in this process (for
  ``forkserver``: the server's own start and its ``import torch`` included, paid once
  per worker process);
* ``first_batch_s``: a new loader's first batch (process start-up included: paid once
  per reader, the processes persist across tasks), median over the repeats;
* ``records_per_s``: the steady rate of a second pass over the same persistent loader;

for ``fork`` (the old way, the baseline), ``forkserver`` (what
:class:`elasticdl.data.torch_dataset.TorchDatasetReader` uses) and ``spawn``. Medians
of ``--repeats`` runs; the last line is JSON with the ratios against ``fork``.

Run: python benchmarks/loader_start.py [--records 20000] [--workers 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time

import torch
from torch.utils.data import DataLoader, Dataset


class Rows(Dataset):
    def __init__(self, n: int, dim: int):
        self.n, self.dim = n, dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.full((self.dim,), float(i)), i % 10


def _ctx(method: str):
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":   # as elasticdl.data.torch_dataset.loader_context does
        ctx.set_forkserver_preload(["torch", "torch.utils.data"])
    return ctx


def run(method: str, records: int, dim: int, workers: int, batch: int) -> tuple[float, float]:
    loader = DataLoader(Rows(records, dim), batch_size=batch, num_workers=workers,
                        persistent_workers=True, multiprocessing_context=_ctx(method),
                        timeout=120)
    start = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    for _ in it:
        pass
    start = time.perf_counter()
    n = sum(len(y) for _, y in loader)
    rate = n / (time.perf_counter() - start)
    loader._iterator._shutdown_workers()  # type: ignore[union-attr]
    return first, rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=20000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="seconds: 2,000 records, 1 repeat")
    args = p.parse_args()
    if args.smoke:
        args.records, args.repeats = 2000, 1
    out: dict[str, dict[str, float]] = {}
    for method in ("fork", "forkserver", "spawn"):
        firsts, rates = [], []
        for _ in range(args.repeats):
            first, rate = run(method, args.records, args.dim, args.workers, args.batch)
            firsts.append(first)
            rates.append(rate)
        out[method] = {"cold_first_batch_s": round(firsts[0], 3),
                       "first_batch_s": round(statistics.median(firsts), 3),
                       "records_per_s": round(statistics.median(rates), 1)}
        print(f"{method:>10}: first batch {out[method]['cold_first_batch_s']:.3f} s cold, "
              f"{out[method]['first_batch_s']:.3f} s median, "
              f"{out[method]['records_per_s']:,.0f} records/s (median of {args.repeats})",
              flush=True)
    base = out["fork"]
    print(json.dumps({**out, "forkserver_first_batch_vs_fork":
                      round(out["forkserver"]["first_batch_s"] / base["first_batch_s"], 2),
                      "forkserver_rate_vs_fork":
                      round(out["forkserver"]["records_per_s"] / base["records_per_s"], 3)}))


if __name__ == "__main__":
    main()
