"""Embedding tables at scale on one PS: memory per row, checkpoints under training, restore.

One PS process through the real servicer (``PServicer`` over a ``PSShard``, Adagrad rows,
async so that every push is applied at once, a checkpoint directory) holds a table of
2^40 ids x 16 float32. A client touches ``--rows`` distinct ids (pull, then push a
gradient: every row gets its Adagrad state). Then:

1. the PS's RSS growth / rows = ``bytes_per_row`` (payload: 64 B weights + 64 B Adagrad
   sum = 128 B; Adagrad without ``lr_decay`` keeps no per-row step), read once the PS
   has handed the fill's freed heap pages back (it does every ``TRIM_EVERY_S``,
   ``common/malloc.py``); ``bytes_per_row_burst``: the same right after the last push;
   ``marginal_bytes_per_row``: the growth over the second half of the rows alone
   (without fixed costs: RPC buffers, the first allocations; burst);
2. a second client pulls and pushes 4,096 hot ids in a loop (its idle round trip is
   measured first); a checkpoint (the ``save_checkpoint`` RPC) is taken while it runs:
   ``checkpoint_block_ms`` is the longest hot round trip during the checkpoint;
3. only the hot rows change, then a second checkpoint: ``delta_ratio`` is its size over
   the first's (1.0: a full copy again);
4. a new shard in this process restores the newest checkpoint: ``restore_s``.

5. eviction under a drifting id stream, on a second PS (a fresh process) with a TTL of
   16 versions (``--embedding_ttl_versions``): each step pulls and pushes the next
   ``window / 4`` new ids of an endless stream and a random ``window / 4`` of the live
   window (the ``window`` newest ids; each is updated every ~4 versions), one model
   version per step. Warm-up: until the table is in its steady state (``window +
   (16 + 4) x window / 4`` = 6 x window distinct ids seen: the rows that left the window
   live 16 versions more); then the stream goes on until the distinct ids seen are 10x
   those of the warm-up. ``evict_rss_ratio`` = PS RSS after the drift / at
   the end of the warm-up; ``evict_table_ratio`` the same of the RSS above the empty PS's
   (the table's own memory, without the process's fixed costs); ``evict_rows_*``,
   ``evict_slots_*``, ``evict_table_mb_*``: the table's live rows, slots and bytes
   (``EmbeddingTable.nbytes``) then, from the PS log; ``evict_rss_series_mb``: the RSS
   each time the distinct ids reached another multiple of the warm-up's.

Run:  python benchmarks/ps_table_scale.py --rows 1000000 [--full_checkpoint_every K]
      python benchmarks/ps_table_scale.py --smoke        (seconds)
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_IDS = 1 << 40
DIM = 16
HOT = 4096
BATCH = 65536


def _optimizer(params: Any) -> Any:
    import torch

    return torch.optim.Adagrad(params, lr=0.01)


def ps_server(port_q: Any, checkpoint_dir: str, extra: dict[str, Any]) -> None:
    """One PS process on 127.0.0.1: ``(port, pid)`` goes to ``port_q``."""
    import torch

    from elasticdl.common.malloc import PS_MALLOC_ARENAS, release_free_heap_every, tune_malloc
    from elasticdl.ps.server import start_server
    from elasticdl.ps.servicer import PServicer
    from elasticdl.ps.shard import PSShard, ShardConfig

    tune_malloc(PS_MALLOC_ARENAS)   # as ps/main.py does
    torch.set_num_threads(1)
    logging.basicConfig(filename=os.path.join(os.path.dirname(checkpoint_dir), "ps.log"),
                        level=logging.INFO)
    # async: every push is applied at once, whatever version the clients last saw
    shard = PSShard(ShardConfig(checkpoint_dir=checkpoint_dir, use_async=True, **extra),
                    _optimizer)
    server, port = start_server(PServicer(shard), 0, "127.0.0.1")
    port_q.put((port, os.getpid()))
    release_free_heap_every(threading.Event())   # as ps/main.py does
    server.wait_for_termination(timeout=7200)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path)
               for f in files)


class HotLoop:
    """Pull then push ``ids`` in a loop on its own client; round-trip times with their
    start."""

    def __init__(self, addr: str, ids: Any):
        from elasticdl.worker.ps_client import PSClient

        self.client = PSClient([addr])
        self.ids = ids
        self.times: list[tuple[float, float]] = []   # (start, seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hot")

    def round(self) -> float:
        import torch

        start = time.monotonic()
        self.client.pull_embedding_unique("emb", self.ids, DIM)
        grad = torch.full((self.ids.shape[0], DIM), 0.01)
        self.client.push_gradients(0, 0, {}, [("emb", self.ids, grad)]).result()
        took = time.monotonic() - start
        self.times.append((start, took))
        return took

    def _run(self) -> None:
        while not self._stop.is_set():
            self.round()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def longest_between(self, t0: float, t1: float) -> float:
        """The longest round trip that overlapped ``[t0, t1]``."""
        return max((d for s, d in self.times if s <= t1 and s + d >= t0), default=0.0)


def lock_figures(log: str) -> dict[str, Any]:
    """How long the PS's checkpoints held the shard lock, from its log: the cut and the
    longest chunk copy of the first (whole) one, the cut of the second (a delta)."""
    import re

    with open(log, encoding="utf-8") as f:
        found = re.findall(r"the lock held ([\d.]+) ms for the cut, at most ([\d.]+) ms per "
                           r"chunk", f.read())
    out: dict[str, Any] = {}
    if found:
        out["lock_cut_ms"], out["lock_chunk_max_ms"] = map(float, found[0])
    if len(found) > 1:
        out["delta_lock_cut_ms"] = float(found[1][0])
    return out


def run(rows: int, extra: dict[str, Any], workdir: str, settle_s: float) -> dict[str, Any]:
    import numpy as np
    import torch

    from elasticdl.checkpoint import paths
    from elasticdl.common.tables import TableSpec
    from elasticdl.ps.shard import PSShard, ShardConfig
    from elasticdl.ps.shard_checkpoint import restore_shard
    from elasticdl.worker.ps_client import PSClient

    ckpt_dir = os.path.join(workdir, "ckpt")
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    ps = ctx.Process(target=ps_server, args=(port_q, ckpt_dir, extra), daemon=True)
    ps.start()
    client = hot = None
    out: dict[str, Any] = {"rows": rows}
    try:
        port, pid = port_q.get(timeout=300)
        addr = f"127.0.0.1:{port}"
        client = PSClient([addr], rpc_timeout_s=1800)
        client.wait_ready(120)
        client.push_model(0, {}, {}, [TableSpec("emb", NUM_IDS, DIM,
                                                initializer="normal:0.01")])
        # warm the RPC paths and the row optimizer (its state tensors) on a few rows
        warm = np.arange(NUM_IDS - 64, NUM_IDS, dtype=np.int64)
        client.pull_embedding_unique("emb", warm, DIM)
        client.push_gradients(0, 0, {}, [("emb", warm, torch.full((64, DIM), 0.1))]).result()
        before = rss_mb(pid)
        ids = np.unique(np.random.default_rng(0).integers(0, NUM_IDS - 64, size=rows))
        while ids.shape[0] < rows:   # collisions are rare at 2^40; top up
            more = np.random.default_rng(ids.shape[0]).integers(0, NUM_IDS - 64, size=rows)
            ids = np.unique(np.concatenate([ids, more]))[:rows]
        np.random.default_rng(1).shuffle(ids)
        start = time.monotonic()
        half = None
        for lo in range(0, rows, BATCH):
            if half is None and lo >= rows // 2:
                half = (lo, rss_mb(pid))
            part = np.sort(ids[lo:lo + BATCH])
            client.pull_embedding_unique("emb", part, DIM)
            grad = torch.full((part.shape[0], DIM), 0.1)
            client.push_gradients(0, 0, {}, [("emb", part, grad)]).result()
        out["touch_s"] = round(time.monotonic() - start, 2)
        after = rss_mb(pid)
        out["bytes_per_row_burst"] = round((after - before) * 2**20 / rows, 1)
        # the PS hands the burst's freed heap pages back every TRIM_EVERY_S
        # (common/malloc.py): what a row costs from then on (the smoke does not wait)
        time.sleep(settle_s)
        growth = rss_mb(pid) - before
        out["rss_growth_mb"] = round(growth, 1)
        out["bytes_per_row"] = round(growth * 2**20 / rows, 1)
        if half is not None:   # the second half's rows alone: without the fixed costs
            out["marginal_bytes_per_row"] = round((after - half[1]) * 2**20 / (rows - half[0]),
                                                  1)

        hot = HotLoop(addr, np.sort(ids[:min(HOT, rows)]))
        idle = sorted(hot.round() for _ in range(15))
        out["idle_round_trip_ms"] = round(1000 * idle[len(idle) // 2], 2)
        hot.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        first = client.save_checkpoint()
        t1 = time.monotonic()
        time.sleep(0.2)
        hot.stop()
        out["checkpoint_s"] = round(t1 - t0, 3)
        out["checkpoint_block_ms"] = round(1000 * hot.longest_between(t0, t1), 1)
        out["hot_rounds_during_checkpoint"] = sum(1 for s, d in hot.times
                                                  if s <= t1 and s + d >= t0)
        out["checkpoint_mb"] = round(dir_bytes(first) / 2**20, 1)
        for _ in range(3):   # only the hot rows change
            hot.round()
        second = client.save_checkpoint()
        out["second_checkpoint_mb"] = round(dir_bytes(second) / 2**20, 3)
        out["delta_ratio"] = round(dir_bytes(second) / dir_bytes(first), 5)
        out.update(lock_figures(os.path.join(workdir, "ps.log")))

        fresh = None
        for _ in range(2):   # the first also pays for lazy imports: the second counts
            fresh = None     # (one restored shard in memory at a time)
            fresh = PSShard(ShardConfig(checkpoint_dir=ckpt_dir), _optimizer)
            start = time.monotonic()
            restore_shard(fresh, paths.resolve(ckpt_dir))
            out["restore_s"] = round(time.monotonic() - start, 3)
        assert fresh is not None
        live = client.pull_embedding_unique("emb", hot.ids, DIM)
        restored = fresh.pull_embedding("emb", hot.ids, create=False)
        out["restore_exact"] = bool(torch.equal(live, restored))
        return out
    finally:
        if hot is not None:
            hot.client.close()
        if client is not None:
            client.close()
        ps.kill()
        ps.join(timeout=10)


def table_rows_logged(log: str) -> tuple[int, int, float]:
    """``(live rows, slots, table MB)`` of the PS's last admission/eviction log line."""
    import re

    with open(log, encoding="utf-8") as f:
        found = re.findall(r"at version \d+: (\d+) rows; (\d+) slots, ([\d.]+) MB;", f.read())
    return (int(found[-1][0]), int(found[-1][1]), float(found[-1][2])) if found else \
        (-1, -1, -1.0)


def run_drift(window: int, workdir: str) -> dict[str, Any]:
    """Phase 5 (see the module doc) on its own PS process."""
    import numpy as np
    import torch

    from elasticdl.common.tables import TableSpec
    from elasticdl.ps.eviction import EmbeddingDefaults
    from elasticdl.worker.ps_client import PSClient

    step_new = max(1, window // 4)
    ttl = 16   # versions: an id of the window is updated every ~4 on average
    drift_dir = os.path.join(workdir, "drift")
    os.makedirs(drift_dir)
    extra = {"embedding": EmbeddingDefaults(ttl_versions=ttl), "table_log_every": 1}
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    ps = ctx.Process(target=ps_server, args=(port_q, os.path.join(drift_dir, "ckpt"), extra),
                     daemon=True)
    ps.start()
    client = None
    out: dict[str, Any] = {"drift_window": window, "drift_ttl_versions": ttl}
    try:
        port, pid = port_q.get(timeout=300)
        client = PSClient([f"127.0.0.1:{port}"], rpc_timeout_s=1800)
        client.wait_ready(120)
        base = rss_mb(pid)
        client.push_model(0, {}, {}, [TableSpec("emb", NUM_IDS, DIM,
                                                initializer="normal:0.01")])
        rng = np.random.default_rng(7)
        mult = np.uint64(0x9E3779B97F4A7C15)

        def stream(lo: int, hi: int) -> Any:   # the k-th id of the stream (distinct)
            with np.errstate(over="ignore"):
                return ((np.arange(lo, hi, dtype=np.uint64) * mult) %
                        np.uint64(NUM_IDS)).astype(np.int64)

        seen = 0
        warm = None
        series: list[float] = []
        start = time.monotonic()
        while True:
            if warm is None and seen >= window + (ttl + 4) * step_new:
                time.sleep(0.2)   # the last version's log line
                warm = (seen, rss_mb(pid), *table_rows_logged(os.path.join(drift_dir,
                                                                        "ps.log")))
            if warm is not None and seen >= (len(series) + 1) * warm[0]:
                series.append(round(rss_mb(pid), 1))   # at 1x, 2x, ... the warm-up's ids
            if warm is not None and seen >= 10 * warm[0]:
                break
            new = stream(seen, seen + step_new)
            seen += step_new
            lo = max(0, seen - window)
            old = stream(lo, seen)[rng.integers(0, seen - lo, size=step_new)]
            batch = np.unique(np.concatenate([new, old]))
            for part in range(0, batch.shape[0], BATCH):
                ids = batch[part:part + BATCH]
                client.pull_embedding_unique("emb", ids, DIM)
                client.push_gradients(0, 0, {}, [("emb", ids, torch.full(
                    (ids.shape[0], DIM), 0.1))]).result()
        time.sleep(0.2)
        after = rss_mb(pid)
        rows_after = table_rows_logged(os.path.join(drift_dir, "ps.log"))
        assert warm is not None
        out["drift_s"] = round(time.monotonic() - start, 1)
        out["drift_distinct_warm"], out["drift_distinct_after"] = warm[0], seen
        out["evict_rss_warm_mb"], out["evict_rss_after_mb"] = round(warm[1], 1), \
            round(after, 1)
        out["evict_rss_ratio"] = round(after / warm[1], 3)
        out["evict_rss_series_mb"] = series
        out["evict_table_ratio"] = round((after - base) / max(warm[1] - base, 1e-9), 3)
        out["evict_rows_warm"], out["evict_rows_after"] = warm[2], rows_after[0]
        out["evict_slots_warm"], out["evict_slots_after"] = warm[3], rows_after[1]
        out["evict_table_mb_warm"], out["evict_table_mb_after"] = warm[4], rows_after[2]
        return out
    finally:
        if client is not None:
            client.close()
        ps.kill()
        ps.join(timeout=10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--full_checkpoint_every", type=int, default=None,
                   help="the PS flag of the same name (default: the PS's default)")
    p.add_argument("--drift_window", type=int, default=None,
                   help="live ids of the drift phase (default: rows / 10, at most 2^16; "
                        "0 skips the phase)")
    p.add_argument("--smoke", action="store_true", help="seconds: 5,000 rows")
    args = p.parse_args()
    if args.smoke:
        args.rows = 5_000
    window = min(args.rows // 10, 1 << 16) if args.drift_window is None else \
        args.drift_window
    extra: dict[str, Any] = {}
    if args.full_checkpoint_every is not None:
        extra["full_checkpoint_every"] = args.full_checkpoint_every
    workdir = tempfile.mkdtemp(prefix="ps_table_scale_")
    try:
        from elasticdl.common.malloc import TRIM_EVERY_S

        out = run(args.rows, extra, workdir, 0.0 if args.smoke else TRIM_EVERY_S + 1.5)
        out["evict_rss_ratio"] = None
        if window > 0:
            out.update(run_drift(window, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"{out['rows']} rows x {DIM} (Adagrad), 1 PS, cpus={os.cpu_count()}: "
          f"{out['bytes_per_row']} B/row; checkpoint {out['checkpoint_s']} s "
          f"({out['checkpoint_mb']} MiB), longest hot round trip during it "
          f"{out['checkpoint_block_ms']} ms (idle {out['idle_round_trip_ms']} ms); second "
          f"checkpoint {out['second_checkpoint_mb']} MiB (ratio {out['delta_ratio']}); "
          f"restore {out['restore_s']} s; drift with TTL eviction: RSS x"
          f"{out['evict_rss_ratio']} (table x{out.get('evict_table_ratio')}) for 10x the ids")
    print(json.dumps(out, separators=(",", ":")))


if __name__ == "__main__":
    main()
