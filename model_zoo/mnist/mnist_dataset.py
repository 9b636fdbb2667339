"""The pytorch/examples MNIST ``Net`` trained through a ``torch.utils.data.Dataset``.

The module defines ``dataset(path, mode)`` instead of relying on the built-in readers: it
returns a map-style dataset of ``(image, label)`` pairs, the master shards it by index
range (its size is ``len(dataset)``), and each worker loads its tasks' minibatches through
a ``torch.utils.data.DataLoader`` (``--data_loader_workers`` processes, ``default_collate``).
With no ``feed`` here, the collated ``(images, labels)`` pair is used as it is: the model
is called as ``model(images)``. ``Net``, its loss, Adadelta and StepLR are
``mnist.mnist_example``'s, unchanged::

    elasticdl train --model_zoo=model_zoo --model_def=mnist.mnist_dataset.custom_model \\
        --training_data=data/digits/train --validation_data=data/digits/val \\
        --data_loader_workers=2 --num_epochs=3
"""

from __future__ import annotations

import glob
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from mnist.mnist_cnn import records_to_tensors
from mnist.mnist_example import Net, custom_model, eval_metrics_fn, loss, lr_scheduler, optimizer

__all__ = ["DigitsDataset", "Net", "custom_model", "dataset", "eval_metrics_fn", "loss",
           "lr_scheduler", "optimizer"]


class DigitsDataset(Dataset):
    """The ``image``/``label`` arrays of the ``.npz`` files of ``path`` (sorted), each
    image standardised as ``mnist.mnist_cnn`` feeds it; label -1 where there is none."""

    def __init__(self, path: str):
        files = sorted(glob.glob(os.path.join(path, "*.npz"))) if os.path.isdir(path) \
            else [path]
        if not files:
            raise FileNotFoundError(f"{path}: no .npz files")
        images, labels = [], []
        for f in files:
            with np.load(f) as z:
                images.append(z["image"])
                n = len(z["image"])
                labels.append(z["label"] if "label" in z else np.full(n, -1, np.int64))
        records = [{"image": im} for im in np.concatenate(images)]
        self.images, _ = records_to_tensors(records, "prediction")
        self.labels = torch.from_numpy(np.concatenate(labels).astype(np.int64))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def dataset(path: str, mode: str) -> Dataset:
    return DigitsDataset(path)
