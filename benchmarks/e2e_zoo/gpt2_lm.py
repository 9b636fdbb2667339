"""A 2-layer GPT-2 built from a config (``transformers``: random init, no download) as a
next-token language model, for ``benchmarks/end_to_end.py``.

Records: npz ``{"tokens": int64[SEQ]}`` from :func:`write_data` (a random first-order
Markov chain over the vocabulary: learnable, not trivial). ``GPT2LMHeadModel`` is the
upstream class unchanged; ``model.pt`` loads into it.
"""

from __future__ import annotations

import os

import numpy as np
import torch

VOCAB, SEQ = 512, 64


def custom_model(n_layer: int = 2, n_embd: int = 64, n_head: int = 2) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                                      vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                                      eos_token_id=0))


def _logits(outputs):
    return outputs.logits if hasattr(outputs, "logits") else outputs[0]


def loss(labels: torch.Tensor, outputs) -> torch.Tensor:
    logits = _logits(outputs)[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels[:, 1:].reshape(-1))


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def feed(records: list, mode: str):
    tokens = torch.from_numpy(np.stack([r["tokens"] for r in records]).astype(np.int64))
    return tokens, tokens


def eval_metrics_fn():
    def token_accuracy(labels, outputs):
        return (_logits(outputs)[:, :-1].argmax(-1) == labels[:, 1:]).float().mean()

    return {"loss": loss, "token_accuracy": token_accuracy}


def write_data(directory: str, n: int, seed: int = 0, files: int = 2) -> None:
    """``n`` sequences of a Markov chain whose rows favour 4 successors per token."""
    chain = np.random.default_rng(1234)  # the language: the same for every split
    succ = chain.integers(0, VOCAB, size=(VOCAB, 4))
    rng = np.random.default_rng(seed)
    tokens = np.empty((n, SEQ), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, VOCAB, size=n)
    for t in range(1, SEQ):
        pick = succ[tokens[:, t - 1], rng.integers(0, 4, size=n)]
        noise = rng.random(n) < 0.1
        tokens[:, t] = np.where(noise, rng.integers(0, VOCAB, size=n), pick)
    os.makedirs(directory, exist_ok=True)
    for i, part in enumerate(np.array_split(np.arange(n), files)):
        np.savez(os.path.join(directory, f"part-{i}.npz"), tokens=tokens[part])
