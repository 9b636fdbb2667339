"""Generate click logs with a planted signal for the DeepFM model.

    python model_zoo/deepfm/gen_data.py --output=data/deepfm [--num_records=200000]
        [--num_files=4] [--val_fraction=0.1] [--seed=0]

writes ``OUTPUT/train/part-0000.npz ...`` and ``OUTPUT/val/part-0000.npz ...``, each with

    ids    (N, 8) int64    one id per categorical field, in [0, FIELD_SIZES[f])
    dense  (N, 4) float32  numeric features
    label  (N,)   float32  click (1) or not (0)

Ids follow a Zipf law per field (a few ids are frequent, the tail is huge), spread over the
vocabulary by a fixed permutation. The click probability is
``sigmoid(sum_f w_f[id_f] + u[id_0] * u[id_1] + dense . v + b)`` with hidden per-id weights, so
first-order terms, one field interaction and the dense features all carry signal; the Bayes AUC
of the generated labels is printed (a trained model approaches it).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

FIELD_SIZES = (500_000, 300_000, 150_000, 50_000, 20_000, 5_000, 1_000, 100)
NUM_DENSE = 4


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half)."""
    order = np.argsort(scores, kind="mergesort")
    s, y = scores[order], labels[order]
    _, start, counts = np.unique(s, return_index=True, return_counts=True)
    avg = start + (counts - 1) / 2.0 + 1
    ranks = np.repeat(avg, counts)
    pos = y > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    if n_pos == 0 or n_neg == 0:
        return 0.5
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def generate(num_records: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hidden = np.random.default_rng(12345)  # the planted model does not depend on --seed
    weights = [hidden.normal(0.0, 0.7, size=n) for n in FIELD_SIZES]
    perms = [hidden.permutation(n) for n in FIELD_SIZES]
    u0 = hidden.normal(0.0, 1.0, size=FIELD_SIZES[0])
    u1 = hidden.normal(0.0, 1.0, size=FIELD_SIZES[1])
    v = hidden.normal(0.0, 0.5, size=NUM_DENSE)
    ids = np.empty((num_records, len(FIELD_SIZES)), dtype=np.int64)
    for f, n in enumerate(FIELD_SIZES):
        rank = np.minimum(rng.zipf(1.2, num_records) - 1, n - 1)
        ids[:, f] = perms[f][rank]
    dense = rng.normal(size=(num_records, NUM_DENSE)).astype(np.float32)
    logit = sum(weights[f][ids[:, f]] for f in range(len(FIELD_SIZES)))
    logit = logit + u0[ids[:, 0]] * u1[ids[:, 1]] + dense @ v - 0.5
    prob = 1.0 / (1.0 + np.exp(-logit))
    label = (rng.random(num_records) < prob).astype(np.float32)
    return {"ids": ids, "dense": dense, "label": label, "prob": prob}


def write(output: str, num_records: int, num_files: int, val_fraction: float,
          seed: int) -> None:
    data = generate(num_records, seed)
    n_val = int(num_records * val_fraction)
    splits = {"val": slice(0, n_val), "train": slice(n_val, num_records)}
    for split, sl in splits.items():
        d = os.path.join(output, split)
        os.makedirs(d, exist_ok=True)
        idx = np.arange(num_records)[sl]
        for i, part in enumerate(np.array_split(idx, num_files)):
            np.savez(os.path.join(d, f"part-{i:04d}.npz"), ids=data["ids"][part],
                     dense=data["dense"][part], label=data["label"][part])
    print(f"wrote {num_records - n_val} training and {n_val} validation records to {output}; "
          f"CTR {data['label'].mean():.3f}; AUC of the true click probability (the best any "
          f"model can do) {auc(data['label'], data['prob']):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True)
    p.add_argument("--num_records", type=int, default=200_000)
    p.add_argument("--num_files", type=int, default=4)
    p.add_argument("--val_fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    write(a.output, a.num_records, a.num_files, a.val_fraction, a.seed)


if __name__ == "__main__":
    main()
