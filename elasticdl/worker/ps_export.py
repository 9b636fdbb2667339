"""A PS worker's model as the PS hold it: built with its tables on the PS, read back
whole (:func:`state_dict`), and exported (:func:`export_model`: ``model.pt`` as the
Local strategy writes it, the big tables as the rows that exist beside it)."""

from __future__ import annotations

import logging
import resource
from collections.abc import Collection, Mapping
from typing import Optional

import numpy as np
import torch

from elasticdl.api.layers import Embedding, tables_on_ps
from elasticdl.api.model_spec import ModelSpec
from elasticdl.api.torch_tables import tables_to_ps
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.sparse_tables import SparseExportWriter, export_bytes
from elasticdl.common.tables import TableSpec
from elasticdl.worker.ps_client import PSClient

logger = logging.getLogger(__name__)


def build_ps_model(model_spec: ModelSpec, job_spec: JobSpec) -> torch.nn.Module:
    """The model as a PS worker holds it: built inside ``tables_on_ps()`` (lazy tables
    without a local weight), torch's qualifying tables swapped for PS tables
    (:func:`~elasticdl.api.torch_tables.tables_to_ps`)."""
    with tables_on_ps():
        model = model_spec.build_model()
    tables_to_ps(model, job_spec.ps_table_min_elements)
    return model


def sparse_tables(declared: Mapping[str, TableSpec], job_spec: JobSpec) -> list[str]:
    """Tables exported as their rows that exist: those of at least
    ``--export_sparse_min_elements`` elements."""
    limit = job_spec.export_sparse_min_elements
    return [n for n, spec in declared.items() if spec.num_embeddings * spec.dim >= limit]


def state_dict(model: torch.nn.Module, client: PSClient, tables: Mapping[str, TableSpec],
               batch_ids: int, skip: Collection[str]) -> dict[str, torch.Tensor]:
    """``model``'s state dict (its dense parameters just pulled) with every table but
    ``skip`` read whole from the PS (rows never trained hold their initial values)."""
    state = {n: t.detach().cpu().clone() for n, t in model.state_dict().items()}
    for name, spec in tables.items():
        if name in skip:
            continue
        table = torch.empty((spec.num_embeddings, spec.dim), dtype=spec.dtype)
        for start in range(0, spec.num_embeddings, batch_ids):
            ids = np.arange(start, min(start + batch_ids, spec.num_embeddings))
            table[start:start + ids.shape[0]] = client.pull_embedding_unique(
                name, ids, spec.dim, spec.dtype, create=False)
        state[name] = table
    return state


def export_model(model_spec: ModelSpec, job_spec: JobSpec, client: PSClient,
                 declared: Mapping[str, TableSpec], sparse: list[str], directory: str,
                 state: dict[str, torch.Tensor],
                 model: Optional[torch.nn.Module] = None) -> list[str]:
    """Write the final model like the Local strategy does (``model.pt``: a plain state
    dict loadable without elasticdl, from ``state``) and the tables ``sparse`` as their
    rows that exist, beside it (:mod:`elasticdl.common.sparse_tables`); returns the
    paths. ``model``: the worker's own model on the CPU, which writes ``state`` with its
    PS tables' weights lent for the write and taken back after (else the model is
    built again: the model code's own initialisation, DLRM's 4.2 M rows of numpy
    values, was 0.9 s of a 2 s export)."""
    from elasticdl.checkpoint.api import export_model as write_model

    paths = []
    if sparse:
        writer = SparseExportWriter(directory)
        for name in sparse:
            spec = declared[name]
            writer.declare(spec)

            def add(ids: np.ndarray, values: torch.Tensor, spec: TableSpec = spec) -> None:
                writer.add(spec, ids, values)

            rows = client.export_rows(name, spec.dim, spec.dtype, add)
            logger.info("exported table %s sparse: %d of %d rows exist", name, rows,
                        spec.num_embeddings)
        paths.append(writer.close())
        logger.info("sparse export written: %s (%d bytes); peak RSS of this process so "
                    "far %.0f MiB", paths[-1], export_bytes(directory),
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if model is None:
        model = build_ps_model(model_spec, job_spec)
    lent: list[tuple[Embedding, Optional[torch.nn.Parameter]]] = []
    try:
        for name, module in model.named_modules():
            if isinstance(module, Embedding):
                key = f"{name}.weight" if name else "weight"
                lent.append((module, module._parameters.get("weight")))
                module.register_parameter("weight", None if key in sparse
                                          else torch.nn.Parameter(state[key]))
        model.load_state_dict(state, strict=True)
        return write_model(model, directory, job_spec.export_torchscript) + paths
    finally:
        for module, weight in lent:   # the worker's model keeps its tables on the PS
            module.register_parameter("weight", weight)
