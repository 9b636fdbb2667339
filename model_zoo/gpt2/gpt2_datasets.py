"""The GPT-2 recipe on a Hugging Face ``datasets`` dataset saved with ``save_to_disk``.

``--training_data=DIR`` names the directory ``Dataset.save_to_disk`` wrote; the built-in
Arrow reader reads its ``.arrow`` files (in ``state.json`` order, without importing
``datasets``) and ``feed`` receives the rows as dicts ``{"input_ids": [...]}``. ``feed``
returns a dict, so the model is called as ``model(**features)``::

    python model_zoo/gpt2/gen_data.py --output=data/gpt2 --format=hf
    elasticdl train --model_zoo=model_zoo --model_def=gpt2.gpt2_datasets.custom_model \\
        --training_data=data/gpt2/train_hf --validation_data=data/gpt2/val_hf
"""

from __future__ import annotations

import torch

from gpt2.gpt2_tiny import custom_model, eval_metrics_fn, loss, optimizer

__all__ = ["custom_model", "eval_metrics_fn", "feed", "loss", "optimizer"]


def feed(records: list, mode: str):
    ids = torch.tensor([r["input_ids"] for r in records], dtype=torch.int64)
    return {"input_ids": ids, "labels": ids}, None
