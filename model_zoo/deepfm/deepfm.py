"""DeepFM (Guo et al., 2017) for click-through-rate prediction, with its embedding tables on the
parameter servers.

Generate data, then train (here with 2 PS and 2 workers)::

    python model_zoo/deepfm/gen_data.py --output=data/deepfm
    elasticdl train --model_zoo=model_zoo --model_def=deepfm.deepfm.custom_model \\
        --training_data=data/deepfm/train --validation_data=data/deepfm/val \\
        --minibatch_size=512 --distribution_strategy=ParameterServerStrategy \\
        --num_ps_pods=2 --num_workers=2

The 8 categorical fields share one id space of 1,026,100 ids (field ``f``'s ids are offset by
the sizes of the fields before it), looked up in two :class:`elasticdl.api.layers.Embedding`
tables: ``embedding`` (dim 8: the FM factors, also the deep part's input) and ``linear``
(dim 1: first-order weights), 2.05M rows in total, created on the PS only when an id is seen.
Logit = bias + first order + FM second order + MLP. Loss: binary cross entropy. Metrics:
``auc`` (the exact AUC of the validation set: ``elasticdl.api.metrics.AUC``), ``logloss`` and
``accuracy`` (per evaluation minibatch, averaged weighted by its size).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from deepfm.gen_data import FIELD_SIZES, NUM_DENSE
from elasticdl.api import metrics
from elasticdl.api.layers import Embedding

EMBEDDING_DIM = 8
LEARNING_RATE = 3e-3


class DeepFM(nn.Module):
    def __init__(self, field_sizes=FIELD_SIZES, num_dense: int = NUM_DENSE,
                 dim: int = EMBEDDING_DIM, hidden=(64, 32)):
        super().__init__()
        offsets = np.concatenate([[0], np.cumsum(field_sizes)[:-1]]).astype(np.int64)
        self.register_buffer("offsets", torch.from_numpy(offsets), persistent=False)
        total = int(sum(field_sizes))
        self.embedding = Embedding(total, dim, initializer="normal:0.01")
        self.linear = Embedding(total, 1, initializer="zeros")
        self.dense_linear = nn.Linear(num_dense, 1)
        layers: list[nn.Module] = []
        width = len(field_sizes) * dim + num_dense
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, features):
        ids, dense = features
        ids = ids + self.offsets
        v = self.embedding(ids)                                   # (B, F, k)
        first = self.linear(ids).sum(dim=(1, 2)) + self.dense_linear(dense).squeeze(-1)
        second = 0.5 * (v.sum(dim=1).pow(2) - v.pow(2).sum(dim=1)).sum(dim=1)
        deep = self.mlp(torch.cat([v.flatten(1), dense], dim=1)).squeeze(-1)
        return first + second + deep


def custom_model() -> nn.Module:
    return DeepFM()


def loss(labels: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(outputs, labels.float())


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LEARNING_RATE)


def feed(records: list, mode: str):
    ids = torch.from_numpy(np.stack([np.asarray(r["ids"], dtype=np.int64) for r in records]))
    dense = torch.from_numpy(np.stack([np.asarray(r["dense"], dtype=np.float32)
                                       for r in records]))
    labels = None
    if mode != "prediction":
        labels = torch.tensor([float(r["label"]) for r in records], dtype=torch.float32)
    return (ids, dense), labels


def auc(labels: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """ROC AUC of scores ``outputs`` for binary ``labels`` (Mann-Whitney U; ties count half).

    0.5 when the batch holds one class only.
    """
    scores = outputs.detach().reshape(-1).float().cpu()
    y = labels.detach().reshape(-1).cpu() > 0.5
    n_pos = int(y.sum())
    n_neg = y.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return torch.tensor(0.5)
    sorted_scores, order = torch.sort(scores)
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True,
                                                  return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    avg_rank = ends - (counts.double() - 1) / 2          # 1-based average rank of each tie group
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[order] = avg_rank[inverse]
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2
    return (u / (n_pos * n_neg)).float()


def logloss(labels: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(outputs.float(), labels.float().to(outputs.device))


def accuracy(labels: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    return ((outputs > 0).float() == labels.to(outputs.device).float()).float().mean()


def eval_metrics_fn() -> dict[str, Any]:
    # the exact AUC of the whole validation set (merged across workers and tasks); ``auc``
    # above is the per-minibatch figure the job reported before
    return {"auc": metrics.AUC(), "logloss": logloss, "accuracy": accuracy}
