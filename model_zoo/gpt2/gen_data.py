"""Token blocks of a small Markov "language" for the GPT-2 recipes (numpy only).

Each token follows its predecessor by a fixed random transition table with a few likely
successors, so a model can learn it and its perplexity has a floor well below the vocabulary
size. ``--format=npy`` writes ``train/part-0000.npy`` and ``val/part-0000.npy`` (int64 rows of
``--block`` tokens); ``--format=hf`` writes Hugging Face ``datasets`` directories with
``save_to_disk`` (column ``input_ids``; needs ``datasets``).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

VOCAB = 16
BLOCK = 16


def transitions(seed: int = 0, vocab: int = VOCAB, successors: int = 3) -> np.ndarray:
    """Row-stochastic (vocab, vocab): each token has ``successors`` likely next tokens."""
    rng = np.random.default_rng(seed)
    probs = np.full((vocab, vocab), 0.02 / vocab)
    for t in range(vocab):
        nxt = rng.choice(vocab, successors, replace=False)
        probs[t, nxt] += rng.dirichlet(np.ones(successors)) * 0.98
    return probs / probs.sum(1, keepdims=True)


def blocks(n: int, seed: int, block: int = BLOCK, vocab: int = VOCAB) -> np.ndarray:
    probs = transitions(0, vocab)
    rng = np.random.default_rng(seed)
    cum = probs.cumsum(1)
    out = np.empty((n, block), dtype=np.int64)
    out[:, 0] = rng.integers(0, vocab, n)
    for j in range(1, block):
        u = rng.random(n)[:, None]
        out[:, j] = np.minimum((u > cum[out[:, j - 1]]).sum(1), vocab - 1)
    return out


def write(output: str, train: int = 1024, val: int = 256, fmt: str = "npy",
          seed: int = 1) -> dict[str, str]:
    """Write the splits; returns ``{split: directory}``."""
    out = {}
    for split, n, s in (("train", train, seed), ("val", val, seed + 1)):
        data = blocks(n, s)
        d = os.path.join(output, split if fmt == "npy" else f"{split}_hf")
        if fmt == "npy":
            os.makedirs(d, exist_ok=True)
            np.save(os.path.join(d, "part-0000.npy"), data)
        else:
            import datasets

            datasets.Dataset.from_dict({"input_ids": data.tolist()}).save_to_disk(d)
        out[split] = d
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output", required=True)
    p.add_argument("--train", type=int, default=1024)
    p.add_argument("--val", type=int, default=256)
    p.add_argument("--format", choices=("npy", "hf"), default="npy")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    print(write(a.output, a.train, a.val, a.format, a.seed))


if __name__ == "__main__":
    main()
