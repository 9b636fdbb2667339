"""The pytorch/examples MNIST recipe, unmodified: its ``Net``, Adadelta and StepLR.

``Net`` is the network of pytorch/examples ``mnist/main.py`` (two 3x3 convolutions, max-pool,
dropout, two linear layers, log-softmax), trained as that script trains it: negative
log-likelihood, ``Adadelta(lr=1.0)`` and ``StepLR(step_size=1, gamma=0.7)`` stepped once per
epoch. The learning rate of epoch ``e`` is therefore ``1.0 * 0.7**e`` in every strategy: the
schedule runs where the optimizer runs (this process, each allreduce member, each PS shard), and
epochs are the master's. ``--model_params="lr=0.5;gamma=0.8"`` changes both without editing
this file.

Records are MNIST's 28x28 images as ``mnist.mnist_cnn`` reads them, so the digits data of
``digits/prepare_data.py`` works as it is::

    elasticdl train --model_zoo=model_zoo --model_def=mnist.mnist_example.custom_model \\
        --training_data=data/digits/train --validation_data=data/digits/val \\
        --num_epochs=3 --minibatch_size=64 --cluster=local \\
        --distribution_strategy=ParameterServerStrategy --num_workers=2 --num_ps_pods=2
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mnist.mnist_cnn import batch_accuracy, records_to_tensors

__all__ = ["Net", "custom_model", "loss", "optimizer", "lr_scheduler", "feed",
           "eval_metrics_fn"]


class Net(nn.Module):
    """pytorch/examples mnist/main.py ``Net``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def custom_model() -> nn.Module:
    return Net()


def loss(labels: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(outputs, labels)


def optimizer(params, lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.Adadelta(params, lr=lr)


def lr_scheduler(optimizer: torch.optim.Optimizer, gamma: float = 0.7):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=gamma)


def feed(records: list, mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    return records_to_tensors(records, mode)


def eval_metrics_fn() -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    return {"accuracy": batch_accuracy}
