"""A ``transformers`` GPT-2 as published, built from a small config (no download), trained
through a ``torch.utils.data.Dataset``.

``GPT2LMHeadModel`` is the upstream class, unmodified and without an adapter module: the
dataset yields ``{"input_ids", "labels"}`` dicts, the DataLoader's ``default_collate``
stacks them, and with no ``feed`` in this module the collated dict is the features, so the
framework calls ``model(**batch)`` and GPT-2 computes its own shifted LM loss. ``loss``
returns ``outputs.loss`` from the ``CausalLMOutputWithCrossAttentions`` the model returns;
checkpoints and the exported ``model.pt`` hold GPT-2's own state-dict keys, so
``GPT2LMHeadModel(config).load_state_dict(torch.load("model.pt"))`` works unchanged.

Data: ``gen_data.py`` writes blocks of tokens of a small Markov "language" as ``.npy``
(``--training_data=DIR/train --validation_data=DIR/val``)::

    python model_zoo/gpt2/gen_data.py --output=data/gpt2
    elasticdl train --model_zoo=model_zoo --model_def=gpt2.gpt2_tiny.custom_model \\
        --training_data=data/gpt2/train --validation_data=data/gpt2/val \\
        --minibatch_size=32 --num_epochs=2 --distribution_strategy=AllreduceStrategy \\
        --num_workers=2 --cluster=local

The validation metric ``loss`` is the mean token cross entropy; perplexity is ``exp(loss)``.
``--model_params="n_layer=4;n_embd=64"`` changes the config.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 16
BLOCK = 16
LEARNING_RATE = 1e-2


def config(n_layer: int = 2, n_embd: int = 32, n_head: int = 2) -> GPT2Config:
    """The small GPT-2 config of this recipe (ids of bos/eos inside the tiny vocabulary)."""
    return GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=n_embd, n_layer=n_layer,
                      n_head=n_head, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)


def custom_model(n_layer: int = 2, n_embd: int = 32, n_head: int = 2) -> GPT2LMHeadModel:
    return GPT2LMHeadModel(config(n_layer, n_embd, n_head))


class TokenBlocks(Dataset):
    """Rows of int64 token ids from the ``.npy`` files of ``path`` (a file or a directory,
    files in sorted order); item ``i`` is ``{"input_ids": row, "labels": row}``."""

    def __init__(self, path: str):
        files = sorted(glob.glob(os.path.join(path, "*.npy"))) if os.path.isdir(path) \
            else [path]
        if not files:
            raise FileNotFoundError(f"{path}: no .npy token files")
        self.blocks = np.concatenate([np.load(f) for f in files]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(self.blocks[i])
        return {"input_ids": ids, "labels": ids}


def dataset(path: str, mode: str) -> Dataset:
    return TokenBlocks(path)


def loss(labels, outputs) -> torch.Tensor:
    return outputs.loss


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.0)


def eval_metrics_fn():
    return {"loss": lambda labels, outputs: outputs.loss}
