"""The digits CNN over a map-style ``torch`` dataset read from Parquet, local or in object
storage (``s3://bucket/prefix``): the module's ``dataset(path, mode)`` gets the URL as given
and reads it through :mod:`elasticdl.api.storage` (the job's ``--data_endpoint`` and
credentials, retries of transient errors). Each process that builds the dataset reads its
files once (a map-style dataset is indexed in memory); the master only learns its length.

Parquet files with an ``image`` column (784 floats in [0, 1]) and a ``label`` column::

    elasticdl train --model_zoo=model_zoo \\
        --model_def=digits.digits_parquet_dataset.custom_model \\
        --training_data=s3://digits/train_parquet --validation_data=s3://digits/val_parquet \\
        --data_endpoint=http://127.0.0.1:8333
"""

from __future__ import annotations

import numpy as np
import torch
from mnist.mnist_cnn import records_to_tensors
from torch.utils.data import Dataset

from digits.digits_cnn import custom_model, eval_metrics_fn, loss, optimizer
from elasticdl.api.storage import data_files, open_input, retrying

__all__ = ["DigitsParquet", "custom_model", "dataset", "eval_metrics_fn", "loss", "optimizer"]


def _read_table(url: str):  # noqa: ANN202 - a pyarrow.Table
    import pyarrow.parquet as pq

    def read():  # noqa: ANN202
        with open_input(url, exact=True) as fp:
            return pq.read_table(fp, columns=["image", "label"])

    return retrying(url, "read as Parquet", read)


class DigitsParquet(Dataset):
    """``(image, label)`` pairs of the Parquet files of ``path``, images standardised as
    ``mnist.mnist_cnn`` feeds them."""

    def __init__(self, path: str):
        images, labels = [], []
        for url in data_files(path):
            table = _read_table(url)
            images.append(np.asarray(table.column("image").to_pylist(), dtype=np.float32))
            labels.append(np.asarray(table.column("label").to_pylist(), dtype=np.int64))
        records = [{"image": im} for im in np.concatenate(images)]
        self.images, _ = records_to_tensors(records, "prediction")
        self.labels = torch.from_numpy(np.concatenate(labels))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def dataset(path: str, mode: str) -> Dataset:
    return DigitsParquet(path)
