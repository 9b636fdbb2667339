"""A token stream for the word_language_model recipe, batchified and cut into
truncated-BPTT chunks as pytorch/examples main.py does.

The text is generated (no download): sentences of a small random grammar over
``--vocab`` words (a first-order Markov chain with a few likely successors per
word), so a model can learn it and its perplexity is far below the vocabulary
size. ``batchify`` lays the stream out in ``batch_size`` columns; chunk ``k`` is
rows ``k*bptt .. k*bptt + bptt`` (``bptt + 1`` rows: input and shifted target),
one record of ``<out>/<split>/part-0000.npy`` ([chunks, bptt + 1, batch_size]
int64). ``tokens(...)`` gives the same stream to a plain loop.
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def tokens(n: int, vocab: int, seed: int) -> np.ndarray:
    """``n`` tokens of the Markov "language" (the chain is fixed by ``vocab``; the
    walk by ``seed``)."""
    chain = np.random.default_rng(12345)
    successors = chain.integers(0, vocab, size=(vocab, 4))
    probs = np.array([0.55, 0.25, 0.15, 0.05])
    rng = np.random.default_rng(seed)
    out = np.empty(n, dtype=np.int64)
    w = 0
    for i in range(n):
        out[i] = w
        w = int(successors[w, rng.choice(4, p=probs)]) if rng.random() > 0.02 \
            else int(rng.integers(0, vocab))
    return out


def batchify(stream: np.ndarray, batch_size: int) -> np.ndarray:
    """[nbatch, batch_size]: column j is the j-th contiguous part of the stream."""
    nbatch = len(stream) // batch_size
    return stream[:nbatch * batch_size].reshape(batch_size, nbatch).T.copy()


def chunks(data: np.ndarray, bptt: int) -> np.ndarray:
    """[N, bptt + 1, batch]: the truncated-BPTT windows (input rows + the next row)."""
    n = (len(data) - 1) // bptt
    return np.stack([data[k * bptt:k * bptt + bptt + 1] for k in range(n)])


def write(out: str, train_tokens: int, val_tokens: int, vocab: int, batch_size: int,
          eval_batch_size: int, bptt: int) -> dict[str, str]:
    paths = {}
    for split, n, bsz, seed in (("train", train_tokens, batch_size, 1),
                                ("val", val_tokens, eval_batch_size, 2)):
        os.makedirs(os.path.join(out, split), exist_ok=True)
        path = os.path.join(out, split, "part-0000.npy")
        np.save(path, chunks(batchify(tokens(n, vocab, seed), bsz), bptt))
        paths[split] = os.path.join(out, split)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--train_tokens", type=int, default=40000)
    p.add_argument("--val_tokens", type=int, default=8000)
    p.add_argument("--vocab", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=20)
    p.add_argument("--eval_batch_size", type=int, default=10)
    p.add_argument("--bptt", type=int, default=35)
    a = p.parse_args()
    print(write(a.out, a.train_tokens, a.val_tokens, a.vocab, a.batch_size,
                a.eval_batch_size, a.bptt))


if __name__ == "__main__":
    main()
