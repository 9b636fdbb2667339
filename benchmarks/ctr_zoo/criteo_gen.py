"""Generated Criteo-shaped click logs: 13 dense features, 26 categorical fields with
Zipf-distributed ids, a label with a planted signal (dense features and per-id effects).

Records are ``.npz`` rows: ``dense`` float32 (13,), ``cat`` int64 (26,), ``label`` float32.
"""

from __future__ import annotations

import os

import numpy as np

NUM_DENSE = 13
NUM_FIELDS = 26


def table_sizes(total_rows: int) -> list[int]:
    """26 table sizes summing to about ``total_rows``, skewed as Criteo's are (a few
    tables hold most ids)."""
    weights = np.array([2.0 ** -(i / 2.5) for i in range(NUM_FIELDS)])
    sizes = np.maximum(4, (weights / weights.sum() * total_rows).astype(np.int64))
    return [int(s) for s in sizes]


def _id_effect(field: int, ids: np.ndarray) -> np.ndarray:
    """A planted effect in [-1, 1) per id of a field: a hash of (field, id)."""
    with np.errstate(over="ignore"):
        z = (ids.astype(np.uint64) + np.uint64(7 + field)) * np.uint64(0x9E3779B97F4A7C15)
        z ^= z >> np.uint64(29)
    return ((z % np.uint64(1000)).astype(np.float64) / 1000.0 - 0.5) * 2.0


def generate(n: int, sizes: list[int], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    dense = np.log1p(rng.lognormal(0.0, 1.2, size=(n, NUM_DENSE))).astype(np.float32)
    cat = np.empty((n, NUM_FIELDS), dtype=np.int64)
    for f, size in enumerate(sizes):
        # Zipf ids (a = 1.2), folded into the table, permuted so hot ids are scattered
        z = rng.zipf(1.2, size=n) - 1
        perm_key = np.uint64(1469598103934665603 + f)
        with np.errstate(over="ignore"):
            cat[:, f] = ((z.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + perm_key)
                         % np.uint64(size)).astype(np.int64)
    logit = 0.8 * (dense[:, 0] - dense[:, 0].mean()) - 0.6 * (dense[:, 3] - dense[:, 3].mean())
    for f in range(8):
        logit = logit + 0.9 * _id_effect(f, cat[:, f])
    logit -= 1.0
    label = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return {"dense": dense, "cat": cat, "label": label}


def write(directory: str, n: int, sizes: list[int], seed: int, files: int = 1) -> None:
    os.makedirs(directory, exist_ok=True)
    data = generate(n, sizes, seed)
    for k, part in enumerate(np.array_split(np.arange(n), files)):
        np.savez(os.path.join(directory, f"part-{k}.npz"),
                 **{key: value[part] for key, value in data.items()})
