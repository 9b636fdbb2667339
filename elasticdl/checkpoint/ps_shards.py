"""Parameter-server checkpoints: one ``torch.save`` file per PS shard.

Layout (shared with :mod:`elasticdl.checkpoint.single`)::

    checkpoint_dir/version-N/ps-<i>-of-<n>.pt   one per PS
    checkpoint_dir/version-N/trained-ps-<i>-of-<n>.json   its data position
    checkpoint_dir/version-N/DONE               once all n shards are there

Each file holds the shard's parameters, optimizer state, learning-rate
schedule (scheduler state and the epoch it is at) and ledger. This module is the
file format (:func:`shard_path`, :func:`load_shards`, :func:`tables_of`) and the export:
:func:`export_state_dict` rebuilds the plain model state dict a user loads with
``model.load_state_dict`` without elasticdl. Saving and restoring a live shard is the
PS's (:mod:`elasticdl.ps.shard_checkpoint`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Collection
from typing import Any

import numpy as np
import torch

from elasticdl.checkpoint import single as ckpt
from elasticdl.common.sparse_tables import SparseRows, sort_rows
from elasticdl.common.tables import TableSpec

logger = logging.getLogger(__name__)

_SHARD_FILE = re.compile(r"^ps-(\d+)-of-(\d+)\.pt$")


def shard_path(version_dir: str, ps_id: int, num_ps: int) -> str:
    return os.path.join(version_dir, f"ps-{ps_id}-of-{num_ps}.pt")


def load_shards(version_dir: str) -> list[dict[str, Any]]:
    """Every shard state of a complete version directory.

    Raises:
        CheckpointError: no DONE marker, shard files missing or of mixed counts.
    """
    vdir = ckpt.resolve(version_dir)
    found = sorted((int(m.group(1)), int(m.group(2))) for m in map(_SHARD_FILE.match,
                                                                    os.listdir(vdir)) if m)
    counts = {n for _, n in found}
    if len(counts) != 1:
        raise ckpt.CheckpointError(f"{vdir}: expected ps-<i>-of-<n>.pt shards of one n, "
                                   f"found (i, n) = {found}")
    n = counts.pop()
    if [i for i, _ in found] != list(range(n)):
        raise ckpt.CheckpointError(f"{vdir}: shards {[i for i, _ in found]} of {n} present")
    return [torch.load(shard_path(vdir, i, n), map_location="cpu", weights_only=True)
            for i in range(n)]


def tables_of(shards: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per table: spec and the rows of all shards concatenated."""
    out: dict[str, dict[str, Any]] = {}
    for s in shards:
        for name, t in s["tables"].items():
            entry = out.setdefault(name, {"spec": TableSpec.from_dict(t["spec"]), "ids": [],
                                          "weights": [], "state": {}, "fill": {}})
            entry["ids"].append(t["ids"].numpy())
            entry["weights"].append(t["weights"])
            for k, v in t["state"].items():
                entry["state"].setdefault(k, []).append(v)
            entry["fill"].update(t["state_fill"])
    for entry in out.values():
        entry["ids"] = np.concatenate(entry["ids"])
        entry["weights"] = torch.cat(entry["weights"])
        entry["state"] = {k: torch.cat(v) for k, v in entry["state"].items()}
    return out


def version_dir_of(checkpoint_dir: str, version: int) -> str:
    """The directory of complete version ``version``.

    Raises:
        CheckpointError: that version is not complete in ``checkpoint_dir``.
    """
    if version not in ckpt.complete_versions(checkpoint_dir):
        raise ckpt.CheckpointError(f"no complete checkpoint version {version} in "
                                   f"{checkpoint_dir}")
    return ckpt.version_dir(checkpoint_dir, version)


def is_sparse(spec: TableSpec, min_elements: int) -> bool:
    """A table inference reads as its rows that exist: of at least ``min_elements``
    elements (``--export_sparse_min_elements``)."""
    return spec.num_embeddings * spec.dim >= min_elements


def sparse_rows(version_dir: str, min_elements: int) -> dict[str, SparseRows]:
    """The tables of a PS checkpoint that :func:`is_sparse`, as the rows that exist
    (memory: those rows, never the table's size; an id never created gets its
    initializer's row, as from the PS)."""
    return {name: sort_rows(t["spec"], t["ids"], t["weights"])
            for name, t in tables_of(load_shards(version_dir)).items()
            if is_sparse(t["spec"], min_elements)}


def export_state_dict(version_dir: str, skip: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """The plain model state dict of a PS checkpoint (``model.load_state_dict`` ready).

    Embedding tables (but ``skip``) come out whole (``num_embeddings x dim``): rows never
    created on a PS hold their initial values, exactly as they would have.
    """
    shards = load_shards(version_dir)
    out: dict[str, torch.Tensor] = {}
    for s in shards:
        out.update(s["dense"])
        out.update(s["buffers"])
    for name, t in tables_of(shards).items():
        if name in skip:
            continue
        spec: TableSpec = t["spec"]
        if spec.explicit:  # every row was pushed and checkpointed
            if np.unique(t["ids"]).shape[0] != spec.num_embeddings:
                raise ckpt.CheckpointError(f"{version_dir}: table {name!r} lacks rows")
            full = torch.empty((spec.num_embeddings, spec.dim), dtype=spec.dtype)
        else:
            full = spec.initial_rows(np.arange(spec.num_embeddings, dtype=np.int64))
        full[torch.from_numpy(t["ids"])] = t["weights"].to(spec.dtype)
        out[name] = full
    return out


def export_model(version_dir: str, output_dir: str) -> str:
    """Write :func:`export_state_dict` to ``output_dir/model.pt``; returns the path."""
    path = os.path.join(output_dir, "model.pt")
    ckpt.save_file(export_state_dict(version_dir), path)
    logger.info("exported %s to %s", version_dir, path)
    return path
