"""What the three CTR model modules of this folder (``dlrm_criteo``, ``deepfm_criteo``,
``deepctr_criteo``) share of the model-module contract: BCE on the models' sigmoid
outputs, upstream DLRM's SGD at lr 0.1 for every model (one effective rate across the
benchmark's runs), exact AUC, and the Criteo-shaped records as arrays."""

from __future__ import annotations

import numpy as np
import torch

from elasticdl.api import metrics


def loss(labels, outputs):
    return torch.nn.functional.binary_cross_entropy(outputs.reshape(-1), labels)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def eval_metrics_fn():
    return {"auc": metrics.AUC()}


def columns(records) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dense, cat, label)`` of a batch of ``.npz`` rows: stacked already (a dict of
    arrays) or a list of records."""
    if isinstance(records, dict):
        dense, cat, label = records["dense"], records["cat"], records["label"]
    else:
        dense = np.stack([r["dense"] for r in records])
        cat = np.stack([r["cat"] for r in records])
        label = np.array([r["label"] for r in records], dtype=np.float32)
    return np.asarray(dense), np.asarray(cat), np.asarray(label)
