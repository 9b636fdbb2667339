"""torchfm's DeepFM (pytorch-fm 0.7.0, ``torchfm.model.dfm`` and ``torchfm.layer``), written
on the standard ``nn.Embedding`` idiom, with :class:`elasticdl.api.layers.Embedding` in place of
``torch.nn.Embedding``.

The classes below are upstream's, line for line, except: the import of ``Embedding``
(``torch.nn.Embedding(...)`` is spelled ``Embedding(...)``) and ``np.long`` (gone from NumPy)
spelled ``np.int64``. ``FeaturesEmbedding`` initialises its table with
``torch.nn.init.xavier_uniform_(self.embedding.weight.data)`` as upstream does; the same seed
gives the same initial rows in Local, allreduce and on the parameter servers.

Data: ``model_zoo/deepfm/gen_data.py`` (8 categorical fields, 1,026,100 ids; upstream DeepFM
takes categorical fields only, so the 4 dense features are not used)::

    python model_zoo/deepfm/gen_data.py --output=data/deepfm
    elasticdl train --model_zoo=model_zoo --model_def=deepfm.deepfm_torchfm.custom_model \\
        --training_data=data/deepfm/train --validation_data=data/deepfm/val \\
        --minibatch_size=256 --num_epochs=3 --distribution_strategy=ParameterServerStrategy \\
        --num_ps_pods=2 --num_workers=2 --grads_to_wait=2

Training as torchfm's ``examples/main.py``: ``BCELoss`` on the sigmoid output, Adam (lr 1e-3,
weight decay 1e-6); plus ``StepLR(step_size=1, gamma=0.7)`` per epoch. Metrics: ``auc``,
``logloss``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from deepfm.deepfm import auc
from deepfm.gen_data import FIELD_SIZES
from elasticdl.api.layers import Embedding


# ---------------------------------------------------------------- torchfm.layer
class FeaturesLinear(torch.nn.Module):

    def __init__(self, field_dims, output_dim=1):
        super().__init__()
        self.fc = Embedding(sum(field_dims), output_dim)
        self.bias = torch.nn.Parameter(torch.zeros((output_dim,)))
        self.offsets = np.array((0, *np.cumsum(field_dims)[:-1]), dtype=np.int64)

    def forward(self, x):
        """
        :param x: Long tensor of size ``(batch_size, num_fields)``
        """
        x = x + x.new_tensor(self.offsets).unsqueeze(0)
        return torch.sum(self.fc(x), dim=1) + self.bias


class FeaturesEmbedding(torch.nn.Module):

    def __init__(self, field_dims, embed_dim):
        super().__init__()
        self.embedding = Embedding(sum(field_dims), embed_dim)
        self.offsets = np.array((0, *np.cumsum(field_dims)[:-1]), dtype=np.int64)
        torch.nn.init.xavier_uniform_(self.embedding.weight.data)

    def forward(self, x):
        """
        :param x: Long tensor of size ``(batch_size, num_fields)``
        """
        x = x + x.new_tensor(self.offsets).unsqueeze(0)
        return self.embedding(x)


class FactorizationMachine(torch.nn.Module):

    def __init__(self, reduce_sum=True):
        super().__init__()
        self.reduce_sum = reduce_sum

    def forward(self, x):
        """
        :param x: Float tensor of size ``(batch_size, num_fields, embed_dim)``
        """
        square_of_sum = torch.sum(x, dim=1) ** 2
        sum_of_square = torch.sum(x ** 2, dim=1)
        ix = square_of_sum - sum_of_square
        if self.reduce_sum:
            ix = torch.sum(ix, dim=1, keepdim=True)
        return 0.5 * ix


class MultiLayerPerceptron(torch.nn.Module):

    def __init__(self, input_dim, embed_dims, dropout, output_layer=True):
        super().__init__()
        layers = list()
        for embed_dim in embed_dims:
            layers.append(torch.nn.Linear(input_dim, embed_dim))
            layers.append(torch.nn.BatchNorm1d(embed_dim))
            layers.append(torch.nn.ReLU())
            layers.append(torch.nn.Dropout(p=dropout))
            input_dim = embed_dim
        if output_layer:
            layers.append(torch.nn.Linear(input_dim, 1))
        self.mlp = torch.nn.Sequential(*layers)

    def forward(self, x):
        """
        :param x: Float tensor of size ``(batch_size, embed_dim)``
        """
        return self.mlp(x)


# ------------------------------------------------------------ torchfm.model.dfm
class DeepFactorizationMachineModel(torch.nn.Module):
    """
    A pytorch implementation of DeepFM.

    Reference:
        H Guo, et al. DeepFM: A Factorization-Machine based Neural Network for CTR
        Prediction, 2017.
    """

    def __init__(self, field_dims, embed_dim, mlp_dims, dropout):
        super().__init__()
        self.linear = FeaturesLinear(field_dims)
        self.fm = FactorizationMachine(reduce_sum=True)
        self.embedding = FeaturesEmbedding(field_dims, embed_dim)
        self.embed_output_dim = len(field_dims) * embed_dim
        self.mlp = MultiLayerPerceptron(self.embed_output_dim, mlp_dims, dropout)

    def forward(self, x):
        """
        :param x: Long tensor of size ``(batch_size, num_fields)``
        """
        embed_x = self.embedding(x)
        x = self.linear(x) + self.fm(embed_x) + self.mlp(embed_x.view(-1, self.embed_output_dim))
        return torch.sigmoid(x.squeeze(1))


# ------------------------------------------------------------ the model module
def custom_model(field_dims=FIELD_SIZES, embed_dim: int = 16, mlp_dims=(16, 16),
                 dropout: float = 0.2, field_size: int = 0) -> torch.nn.Module:
    """torchfm ``examples/main.py``'s DeepFM: embed_dim 16, mlp_dims (16, 16), dropout 0.2.

    ``--model_params=field_size=N`` gives every field N ids instead of ``gen_data``'s sizes
    (small tables: a laptop demo, the test suite's click log)."""
    if field_size > 0:
        field_dims = (field_size,) * len(field_dims)
    return DeepFactorizationMachineModel(list(field_dims), embed_dim, tuple(mlp_dims), dropout)


def loss(labels: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy(outputs, labels.float())


def optimizer(params, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr, weight_decay=1e-6)


def lr_scheduler(optimizer: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)


def feed(records: list, mode: str):
    """npz records of ``gen_data.py`` -> (ids (B, 8) int64, labels (B,) float32)."""
    ids = torch.from_numpy(np.stack([np.asarray(r["ids"], dtype=np.int64) for r in records]))
    labels = None
    if mode != "prediction":
        labels = torch.tensor([float(r["label"]) for r in records], dtype=torch.float32)
    return ids, labels


def logloss(labels: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy(outputs.float(), labels.float())


def eval_metrics_fn() -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    return {"auc": auc, "logloss": logloss}
