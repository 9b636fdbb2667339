"""Tensors nested in dicts, lists and tuples (a model's features, labels and state)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

Path = tuple[Any, ...]   # keys and indexes from the top of a nested structure to a tensor


def leaves(obj: Any, path: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    """Every tensor in ``obj`` (nested in dicts, lists and tuples, in their order) with
    its path."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from leaves(v, path + (i,))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, path + (k,))


def to_device(obj: Any, device: torch.device) -> Any:
    """Move a tensor, or tensors nested in dicts/lists/tuples, to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj
