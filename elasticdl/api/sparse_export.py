"""Inference from a model whose big tables were exported sparse.

A ParameterServerStrategy job writes ``model.pt`` (every dense parameter, buffer and small
table: a plain state dict) and, beside it, its big tables as the rows that exist
(``sparse_tables/``, see :mod:`elasticdl.common.sparse_tables`). :func:`load_model` gives
inference code the model with both::

    from elasticdl.api.sparse_export import load_model
    import my_model

    model = load_model("out/ctr-job", my_model.custom_model)   # builds it, loads both
    model.eval()
    scores = model(dense_x, offsets, indices)

Each sparse table's module (a torch ``nn.Embedding``/``nn.EmbeddingBag`` is swapped for
its :mod:`elasticdl.api.layers` equivalent, same attribute and options) looks its rows up
in the exported ones; an id never trained gets the value the trained model gave it (the
lazy table's initializer row). Building the model through :func:`load_model` (a factory,
not a built model) does it inside :func:`~elasticdl.api.layers.tables_on_ps`, so a lazy
table of 2^31 ids is never materialised. Without elasticdl, ``model.pt`` alone loads with
``model.load_state_dict(torch.load(...), strict=False)`` (every key but the sparse tables).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Union

import numpy as np
import torch
from torch import nn

from elasticdl.api.layers import Embedding, PulledRows, tables_on_ps
from elasticdl.api.torch_tables import convert
from elasticdl.common.sparse_tables import SparseRows, has_sparse_export, read_tables

__all__ = ["ExportedRows", "attach_rows", "load_model"]


class ExportedRows:
    """A table's lookup served from its exported rows (no gradient: inference)."""

    def __init__(self, rows: SparseRows):
        self.rows = rows

    def __call__(self, layer: Embedding, ids: torch.Tensor) -> PulledRows:
        flat = ids.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        uniq, inverse = np.unique(flat, return_inverse=True)
        rows = self.rows.lookup(uniq).to(ids.device)
        pad = None
        if layer.padding_idx is not None:
            hit = int(np.searchsorted(uniq, layer.padding_idx))
            if hit < uniq.shape[0] and uniq[hit] == layer.padding_idx:
                pad = hit
        return PulledRows(rows, torch.from_numpy(inverse.reshape(ids.shape)).to(ids.device), pad)


def _as_layer(module: nn.Module, name: str) -> Embedding:
    if isinstance(module, Embedding):
        return module
    if type(module) in (nn.Embedding, nn.EmbeddingBag):
        return convert(module, name, check=False)  # type: ignore[arg-type]
    raise ValueError(f"exported table {name!r}: module {type(module).__name__} is not an "
                     "embedding table")


def attach_rows(model: nn.Module, tables: Mapping[str, SparseRows]) -> nn.Module:
    """Make each table in ``tables`` (by state-dict key, ``<module>.weight``) look its
    rows up in the given ones; torch's table modules are swapped for their ``layers``
    equivalents in place. Returns ``model``.

    Raises:
        ValueError: a key that names no embedding module of ``model``, or whose
            module's shape differs from the exported table's.
    """
    for key, rows in tables.items():
        module_name, _, leaf = key.rpartition(".")
        if leaf != "weight" or not module_name:
            raise ValueError(f"exported table {key!r} is not a submodule's weight")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            raise ValueError(f"exported table {key!r}: the model has no module "
                             f"{module_name!r}") from None
        layer = _as_layer(module, key)
        if (layer.num_embeddings, layer.embedding_dim) != (rows.spec.num_embeddings,
                                                           rows.spec.dim):
            raise ValueError(f"exported table {key!r} is {rows.spec.num_embeddings} x "
                             f"{rows.spec.dim}; the model's is {layer.num_embeddings} x "
                             f"{layer.embedding_dim}")
        if layer is not module:
            parent_name, _, attr = module_name.rpartition(".")
            model.get_submodule(parent_name)._modules[attr] = layer
        layer.register_parameter("weight", None)  # inference: frozen or not, rows served
        layer.attach(ExportedRows(rows), key)
    return model


def load_model(export_dir: str,
               model: Union[nn.Module, Callable[[], nn.Module]]) -> nn.Module:
    """The model of a job's export: ``model.pt`` loaded into it, its sparse tables
    attached (:func:`attach_rows`). ``model`` is the model (or, better, its factory,
    called inside ``tables_on_ps()`` so lazy tables stay unmaterialised).

    Raises:
        FileNotFoundError: no ``model.pt`` in ``export_dir``.
        ValueError: the export does not fit the model.
    """
    if not isinstance(model, nn.Module):
        with tables_on_ps():
            model = model()
    tables = read_tables(export_dir) if has_sparse_export(export_dir) else {}
    attach_rows(model, tables)
    state = torch.load(os.path.join(export_dir, "model.pt"), map_location="cpu",
                       weights_only=True)
    model.load_state_dict(state)
    return model
