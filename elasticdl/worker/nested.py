"""Tensors nested in dicts, lists and tuples (a model's features, labels and state)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def to_device(obj: Any, device: torch.device) -> Any:
    """Move a tensor, or tensors nested in dicts/lists/tuples, to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj
