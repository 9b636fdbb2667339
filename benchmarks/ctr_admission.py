"""The AUC cost of admission and eviction of PS embedding rows, on generated click data.

The data of ``ctr_models`` (``ctr_zoo/criteo_gen``: 13 dense features, 26 Zipf categorical
fields, a planted signal), one pass. The model: one lazy table holding the 26 fields' ids
(``--table_rows`` ids in all, 8 wide, Adagrad rows on a real :class:`PSShard`, async: each
push applied at once, one model version per batch), the 26 looked-up rows and the dense
features into an MLP 221-64-1 (Adagrad, in this process). The same records in the same
order are trained under each policy (``--policies``):

* ``off``: every id gets a row at once, nothing evicted (today's behaviour);
* ``admit2`` / ``admit3``: a row on an id's 2nd / 3rd training pull;
* ``ttl``: rows not updated for ``--ttl`` versions evicted;
* ``cap``: at most ``--cap_frac`` of the distinct training ids as rows (LRU beyond);
* ``all``: admit2 + ttl + cap.

Each reports the exact validation AUC (``elasticdl.api.metrics.AUC``; validation pulls
create nothing: an id without a row reads its initializer row), the rows held at the end,
and the rows admitted / evicted. The last line is JSON.

Run: python benchmarks/ctr_admission.py [--records 100000] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

DIM = 8


def policies(ttl: int, cap: int) -> dict[str, dict[str, int]]:
    return {"off": {}, "admit2": {"admit_after": 2}, "admit3": {"admit_after": 3},
            "ttl": {"ttl_versions": ttl}, "cap": {"max_rows": cap},
            "all": {"admit_after": 2, "ttl_versions": ttl, "max_rows": cap}}


def train_eval(policy: dict[str, int], train: dict[str, Any], val: dict[str, Any],
               offsets: Any, num_ids: int, batch: int, seed: int) -> dict[str, Any]:
    import numpy as np
    import torch

    from elasticdl.api.metrics import AUC
    from elasticdl.common.tables import TableSpec
    from elasticdl.ps.eviction import EmbeddingDefaults
    from elasticdl.ps.shard import GradientPush, PSShard, ShardConfig

    torch.manual_seed(seed)
    shard = PSShard(ShardConfig(use_async=True, table_log_every=0,
                                embedding=EmbeddingDefaults(**policy)),
                    lambda params: torch.optim.Adagrad(params, lr=0.05))
    shard.initialize(0, {}, {}, [TableSpec("emb", num_ids, DIM, initializer="normal:0.01",
                                           seed=seed)])
    fields = offsets.shape[0]
    mlp = torch.nn.Sequential(torch.nn.Linear(13 + fields * DIM, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 1))
    opt = torch.optim.Adagrad(mlp.parameters(), lr=0.05)

    def forward(lo: int, data: dict[str, Any], training: bool) -> tuple[Any, Any]:
        ids = data["cat"][lo:lo + batch] + offsets[None, :]
        uniq, inverse = np.unique(ids, return_inverse=True)
        rows = shard.pull_embedding("emb", uniq, create=training).requires_grad_(training)
        emb = rows[torch.from_numpy(inverse.reshape(-1))].view(ids.shape[0], -1)
        x = torch.cat([torch.from_numpy(data["dense"][lo:lo + batch]), emb], dim=1)
        return mlp(x).squeeze(1), (uniq, rows)

    n = train["label"].shape[0]
    start = time.perf_counter()
    for lo in range(0, n, batch):
        logits, (uniq, rows) = forward(lo, train, True)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, torch.from_numpy(train["label"][lo:lo + batch]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        shard.push_gradients(GradientPush(version=shard.version,
                                          sparse=[("emb", uniq, rows.grad)]))
    wall = time.perf_counter() - start
    auc = AUC()
    with torch.no_grad():
        for lo in range(0, val["label"].shape[0], batch):
            logits, _ = forward(lo, val, False)
            auc.update(torch.from_numpy(val["label"][lo:lo + batch]), torch.sigmoid(logits))
    t = shard.params.tables["emb"]
    return {"auc": round(float(auc.compute()), 4), "rows": t.live_rows, "slots": t.size,
            "admitted": t.stats["admitted"], "grads_dropped": t.stats["grads_dropped"],
            "evicted": t.stats["evicted_ttl"] + t.stats["evicted_capacity"],
            "train_s": round(wall, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--val_records", type=int, default=20_000)
    p.add_argument("--table_rows", type=int, default=1_000_000, help="ids of all 26 fields")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ttl", type=int, default=100, help="versions (batches)")
    p.add_argument("--cap_frac", type=float, default=0.5,
                   help="max_rows as a fraction of the distinct training ids")
    p.add_argument("--policies", default="off,admit2,admit3,ttl,cap,all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    a = p.parse_args()
    if a.smoke:
        a.records, a.val_records, a.table_rows, a.ttl = 4096, 1024, 26 * 400, 8
    import numpy as np
    import torch
    from ctr_zoo import criteo_gen

    torch.set_num_threads(1)
    sizes = criteo_gen.table_sizes(a.table_rows)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    train = criteo_gen.generate(a.records, sizes, a.seed)
    val = criteo_gen.generate(a.val_records, sizes, a.seed + 1)
    distinct = int(np.unique(train["cat"] + offsets[None, :]).shape[0])
    cap = max(64, int(a.cap_frac * distinct))
    results: dict[str, Any] = {"records": a.records, "val_records": a.val_records,
                               "table_ids": int(sum(sizes)), "distinct_train_ids": distinct,
                               "batch": a.batch, "ttl_versions": a.ttl, "max_rows": cap}
    table = policies(a.ttl, cap)
    for name in a.policies.split(","):
        results[name] = train_eval(table[name], train, val, offsets, int(sum(sizes)),
                                   a.batch, a.seed)
        print(f"[{name}] {results[name]}", flush=True)
    if "off" in results:
        results["auc_minus_off"] = {k: round(results[k]["auc"] - results["off"]["auc"], 4)
                                    for k in a.policies.split(",") if k != "off"}
    print(json.dumps(results, separators=(",", ":")))


if __name__ == "__main__":
    main()
