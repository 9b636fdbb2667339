"""The classic MNIST CNN and its model-module functions.

This module is also the shared definition used by ``digits.digits_cnn``: the CNN class and the
record -> tensor conversion live here only.  Load it with
``--model_zoo=model_zoo --model_def=mnist.mnist_cnn.custom_model``.

Records ``feed`` accepts (one minibatch at a time):

* dict records from ``.npz`` shards: ``{"image": (28, 28) array, "label": int}``; ``image`` may
  be float (already in [0, 1]) or ``uint8`` (0..255, as written by ``mnist/idx.py``), which is
  scaled to [0, 1].  ``label`` may be absent in prediction.
* CSV records (a list of str fields): 784 pixel values followed by the label; in prediction the
  label may be left out (784 fields).
* ``.npy`` rows: a numpy array of 785 values (pixels then label) or 784 / (28, 28) pixels.

Features come out standardised: (pixel - 0.1307) / 0.3081, pixel in [0, 1].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

IMAGE_SIZE = 28
NUM_PIXELS = IMAGE_SIZE * IMAGE_SIZE
NUM_CLASSES = 10
MODES = ("training", "evaluation", "prediction")
# Pixels in [0, 1] are standardised with MNIST's mean and std, as the classic PyTorch MNIST
# example does (transforms.Normalize((0.1307,), (0.3081,))); it trains markedly faster.
PIXEL_MEAN = 0.1307
PIXEL_STD = 0.3081


class CNN(nn.Module):
    """conv(1->16, k5, p2) ReLU maxpool2; conv(16->32, k5, p2) ReLU maxpool2; linear(32*7*7->10)."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=5, padding=2)
        self.fc = nn.Linear(32 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


# ---------------------------------------------------------------------------------------------
# Shared helpers (also used by digits.digits_cnn)
# ---------------------------------------------------------------------------------------------


def cross_entropy_loss(labels: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, labels.long())


def batch_accuracy(labels: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """Fraction of the batch whose arg-max class equals the label."""
    labels = torch.as_tensor(labels)
    return (outputs.argmax(dim=1) == labels.to(outputs.device).long()).float().mean()


def _to_float_pixels(pixels: np.ndarray) -> np.ndarray:
    if pixels.dtype == np.uint8:
        return pixels.astype(np.float32) / np.float32(255.0)
    return pixels.astype(np.float32, copy=False)


def _field_rows_to_arrays(
    records: Sequence[Any], mode: str
) -> tuple[np.ndarray, np.ndarray | None]:
    """CSV field lists (or whole CSV lines) or .npy rows: 784 pixels [+ label]."""
    rows: list[Any] = []
    lengths = set()
    for i, record in enumerate(records):
        if isinstance(record, np.ndarray):
            row = np.ravel(record)
        elif isinstance(record, str):  # a whole CSV line, e.g. from the text reader
            row = record.split(",")
        else:
            row = record
        n = len(row)
        if n not in (NUM_PIXELS, NUM_PIXELS + 1) or (n == NUM_PIXELS and mode != "prediction"):
            expected = (
                f"{NUM_PIXELS + 1} (784 pixel values then the label)"
                if mode != "prediction"
                else f"{NUM_PIXELS + 1} or {NUM_PIXELS} (784 pixel values [then the label])"
            )
            raise ValueError(
                f"record {i} of the batch has {n} fields, expected {expected} "
                f"in {mode} mode"
            )
        lengths.add(n)
        rows.append(row)
    if len(lengths) > 1:
        raise ValueError("records of one batch mix rows with and without a label field")
    if isinstance(rows[0], np.ndarray):  # .npy rows keep their dtype (uint8 pixels are scaled)
        table = np.stack(rows)
        pixels = _to_float_pixels(table[:, :NUM_PIXELS])
    else:  # CSV: lists of str fields
        try:
            table = np.asarray(rows, dtype=np.float64)
        except ValueError as err:
            raise ValueError(f"records hold a field that is not a number: {err}") from err
        pixels = table[:, :NUM_PIXELS].astype(np.float32)
    if table.shape[1] == NUM_PIXELS:
        return pixels, None
    raw_labels = table[:, NUM_PIXELS]
    labels = raw_labels.astype(np.int64)
    if not np.array_equal(labels, raw_labels):
        raise ValueError("the label field (last field of a record) must be an integer")
    return pixels, labels


def _dict_records_to_arrays(
    records: Sequence[dict[str, Any]], mode: str
) -> tuple[np.ndarray, np.ndarray | None]:
    try:
        images = np.stack([np.asarray(r["image"]) for r in records])
    except KeyError as err:
        keys = sorted(records[0])
        raise ValueError(f"npz records must hold an 'image' array, got keys {keys}") from err
    if images[0].size != NUM_PIXELS:
        raise ValueError(f"each image must hold {NUM_PIXELS} pixels (28x28), got {images[0].shape}")
    images = _to_float_pixels(images.reshape(len(records), NUM_PIXELS))
    if all("label" in r for r in records):
        labels = np.asarray([np.asarray(r["label"]).item() for r in records], dtype=np.int64)
        return images, labels
    if mode != "prediction":
        raise ValueError(f"npz records need a 'label' array in {mode} mode")
    return images, None


def records_to_tensors(
    records: Sequence[Any], mode: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Turn a minibatch of records into float32 (N, 1, 28, 28) features and int64 (N,) labels.

    Features are the [0, 1] pixels standardised as (x - PIXEL_MEAN) / PIXEL_STD.
    Labels are None only in prediction mode when the records carry no label.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}, expected one of {MODES}")
    records = list(records)
    if not records:
        empty = torch.zeros((0, 1, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.float32)
        return empty, torch.zeros((0,), dtype=torch.int64)
    if isinstance(records[0], dict):
        pixels, labels = _dict_records_to_arrays(records, mode)
    else:
        pixels, labels = _field_rows_to_arrays(records, mode)
    pixels = (pixels - np.float32(PIXEL_MEAN)) / np.float32(PIXEL_STD)
    features = torch.from_numpy(np.ascontiguousarray(pixels)).reshape(-1, 1, IMAGE_SIZE, IMAGE_SIZE)
    return features, (None if labels is None else torch.from_numpy(labels))


# ---------------------------------------------------------------------------------------------
# The model-module contract
# ---------------------------------------------------------------------------------------------


def custom_model() -> nn.Module:
    return CNN()


def loss(labels: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    return cross_entropy_loss(labels, outputs)


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def feed(records: list, mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    return records_to_tensors(records, mode)


def eval_metrics_fn() -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    return {"accuracy": batch_accuracy}
