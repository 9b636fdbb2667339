"""Parameter-server checkpoints: one ``torch.save`` file per PS shard.

Layout (shared with :mod:`elasticdl.checkpoint.single`)::

    checkpoint_dir/version-N/ps-<i>-of-<n>.pt   one per PS
    checkpoint_dir/version-N/trained-ps-<i>-of-<n>.json   its data position
    checkpoint_dir/version-N/ps-<i>-of-<n>.delta.json     only beside a delta shard
    checkpoint_dir/version-N/DONE               once all n shards are there

Each file holds the shard's parameters, optimizer state, learning-rate
schedule (scheduler state and the epoch it is at) and ledger, and its embedding rows:
all of them (a *whole* shard), or only the rows changed since the PS's previous
checkpoint (a *delta*: ``"delta": {"prev_version", "full_version"}``, per table the rows'
``slots`` and the table's ``size`` at the cut). A slot whose row was evicted holds id -1
(a tombstone; a delta carries it, and per table ``evicted``: the ids evicted since the
previous checkpoint); every reader drops those rows (:func:`tables_of`). A delta is read
as the whole shard it completes: :func:`load_shard` folds the chain (the whole one, then
each delta in order) by slot, so every reader gets whole tables. Retention
(:func:`mark_done`) keeps the versions the kept ones are deltas of. This module is the
file format (:func:`shard_path`, :func:`load_shards`, :func:`tables_of`) and the export:
:func:`export_state_dict` rebuilds the plain model state dict a user loads with
``model.load_state_dict`` without elasticdl. Saving and restoring a live shard is the
PS's (:mod:`elasticdl.ps.shard_checkpoint`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Collection
from typing import Any, Optional

import numpy as np
import torch

from elasticdl.checkpoint import paths, staging
from elasticdl.checkpoint import single as ckpt
from elasticdl.common.sparse_tables import SparseRows, sort_rows
from elasticdl.common.tables import TableSpec

logger = logging.getLogger(__name__)

_SHARD_FILE = re.compile(r"^ps-(\d+)-of-(\d+)\.pt$")


def shard_path(version_dir: str, ps_id: int, num_ps: int) -> str:
    return os.path.join(version_dir, f"ps-{ps_id}-of-{num_ps}.pt")


def shard_count(version_dir: str) -> tuple[str, int]:
    """``(directory, n)`` of a complete version directory of ``n`` PS shard files.

    Raises:
        CheckpointError: no DONE marker, shard files missing or of mixed counts.
    """
    vdir = ckpt.resolve(version_dir)
    staging.ensure(vdir)   # a staged checkpoint (object storage): its shards come down
    found = sorted((int(m.group(1)), int(m.group(2))) for m in map(_SHARD_FILE.match,
                                                                    os.listdir(vdir)) if m)
    counts = {n for _, n in found}
    if len(counts) != 1:
        raise ckpt.CheckpointError(f"{vdir}: expected ps-<i>-of-<n>.pt shards of one n, "
                                   f"found (i, n) = {found}")
    n = counts.pop()
    if [i for i, _ in found] != list(range(n)):
        raise ckpt.CheckpointError(f"{vdir}: shards {[i for i, _ in found]} of {n} present")
    return vdir, n


def load_shards(version_dir: str) -> list[dict[str, Any]]:
    """Every shard state of a complete version directory (:func:`shard_count`)."""
    vdir, n = shard_count(version_dir)
    return [load_shard(vdir, i, n) for i in range(n)]


def _load(path: str) -> dict[str, Any]:
    # mapped, not read: a restore copies each table once, from the page cache into its
    # rows, instead of reading the file into memory first (a second copy of the table).
    # Private mapping: folding a delta onto it writes to copies of the pages, never to
    # the file, and a file removed meanwhile (retention) stays readable until unmapped.
    # Everything but the rows is cloned, so what a restored PS keeps (dense parameters,
    # optimizer state, ledger) never pins the file's mapping.
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return {k: v if k == "tables" else _owned(v) for k, v in state.items()}


def _owned(obj: Any) -> Any:
    """``obj`` with every tensor in it cloned (dicts, lists and tuples walked)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _owned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_owned(v) for v in obj)
    return obj


def load_shard(version_dir: str, ps_id: int, num_ps: int) -> dict[str, Any]:
    """Shard ``ps_id`` of ``version_dir`` with whole tables: a delta is folded onto the
    whole shard its chain starts from (the delta's own dense parameters, optimizer
    state, ledger and version are the state's).

    Raises:
        CheckpointError: a shard the chain needs is missing, or does not match.
    """
    path = shard_path(version_dir, ps_id, num_ps)
    chain = [_load(path)]
    while chain[-1].get("delta"):
        prev = int(chain[-1]["delta"]["prev_version"])
        prev_path = shard_path(ckpt.version_dir(os.path.dirname(os.path.normpath(
            version_dir)), prev), ps_id, num_ps)
        if not os.path.exists(prev_path):
            raise ckpt.CheckpointError(f"{path} is a delta of version {prev}, whose shard "
                                       f"{prev_path} is missing")
        chain.append(_load(prev_path))
    whole = chain.pop()
    if not chain:
        return whole
    deltas = chain[::-1]   # oldest first
    out = dict(deltas[-1])
    out.pop("delta")
    out["tables"] = {name: _fold(name, t, [d["tables"].get(name) for d in deltas], path)
                     for name, t in whole["tables"].items()}
    return out


def _fold(name: str, whole: dict[str, Any], deltas: list[Optional[dict[str, Any]]],
          path: str) -> dict[str, Any]:
    """One table of a whole shard with its deltas applied (oldest first), by slot."""
    n0 = int(whole["ids"].shape[0])
    size = max([n0] + [int(d["size"]) for d in deltas if d is not None])
    ids = np.empty(size, dtype=np.int64)
    ids[:n0] = whole["ids"].numpy()
    weights = whole["weights"]
    state = dict(whole["state"])
    fill = dict(whole["state_fill"])
    for d in deltas:
        if d is not None:
            fill.update(d["state_fill"])
            for k, v in d["state"].items():
                if k not in state:   # created after the whole one: every row at its fill
                    state[k] = torch.full((n0,) + tuple(v.shape[1:]), fill[k], dtype=v.dtype)
    if size > n0:   # grown once, to the newest size
        weights = torch.cat([weights, weights.new_empty((size - n0,) + weights.shape[1:])])
        state = {k: torch.cat([v, v.new_full((size - n0,) + tuple(v.shape[1:]), fill[k])])
                 for k, v in state.items()}
    known = n0
    for d in deltas:
        if d is None:
            continue
        slots = d["slots"].numpy()
        d_ids = d["ids"].numpy()
        old = slots < known
        was, now = ids[slots[old]], d_ids[old]
        # a slot keeps its id, or changes through an eviction (a tombstone, a reuse)
        gone = d["evicted"].numpy() if "evicted" in d else np.zeros(0, np.int64)
        same = (was == now) | (was < 0) | (now < 0) | np.isin(was, gone) | \
            (not d.get("evicted_complete", True))
        if not same.all() or \
                not np.array_equal(np.sort(slots[~old]), np.arange(known, int(d["size"]))):
            raise ckpt.CheckpointError(f"{path}: table {name!r}: a delta does not match the "
                                       "rows it applies to")
        ids[slots] = d_ids
        st = torch.from_numpy(slots)
        weights.index_copy_(0, st, d["weights"])
        for k, v in d["state"].items():
            state[k].index_copy_(0, st, v)
        known = max(known, int(d["size"]))
    return {"spec": whole["spec"], "ids": torch.from_numpy(ids), "weights": weights,
            "state": state, "state_fill": fill,
            **_folded_clocks(whole, deltas, size),
            "partial": any(bool(d.get("partial")) for d in [whole, *deltas] if d is not None)}


def write_delta_note(version_dir: str, ps_id: int, num_ps: int,
                     delta: Optional[dict[str, int]]) -> None:
    """Beside a delta shard, the versions it needs (torch-free: retention and downloads
    read it, :func:`elasticdl.checkpoint.paths.delta_notes`); a whole shard has none."""
    path = os.path.join(version_dir, f"ps-{ps_id}-of-{num_ps}{paths.DELTA_NOTE}")
    if delta is None:
        if os.path.exists(path):
            os.remove(path)
        return
    os.makedirs(version_dir, exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(delta, f)
    os.replace(path + ".tmp", path)


def mark_done(checkpoint_dir: str, version: int, keep_max: int = 0) -> None:
    """Mark a PS checkpoint version complete and keep the newest ``keep_max`` (0: all),
    with every version a kept delta is folded from."""
    ckpt.mark_done(checkpoint_dir, version, 0)
    if keep_max <= 0:
        return
    versions = ckpt.complete_versions(checkpoint_dir)
    kept = versions[-keep_max:]
    floor = min(paths.oldest_needed(ckpt.version_dir(checkpoint_dir, v)) for v in kept)
    for old in versions[:-keep_max]:
        if old < floor:
            shutil.rmtree(ckpt.version_dir(checkpoint_dir, old), ignore_errors=True)


def _folded_clocks(whole: dict[str, Any], deltas: list[Optional[dict[str, Any]]],
                   size: int) -> dict[str, Any]:
    """``{"clocks": ...}``, the rows' last-update versions with the deltas' applied by
    slot, when the whole shard and every delta kept them (else ``{}``)."""
    parts = [whole] + [d for d in deltas if d is not None]
    if any("clocks" not in p for p in parts):
        return {}
    clocks = np.zeros(size, dtype=np.int32)
    clocks[:int(whole["ids"].shape[0])] = whole["clocks"].numpy()
    for d in parts[1:]:
        clocks[d["slots"].numpy()] = d["clocks"].numpy()
    return {"clocks": torch.from_numpy(clocks)}


def tables_of(shards: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per table: spec and the rows of all shards concatenated (evicted slots dropped);
    ``clocks``, the rows' last-update versions (int32 bits of uint32) when every shard
    kept them, else None."""
    out: dict[str, dict[str, Any]] = {}
    for s in shards:
        for name, t in s["tables"].items():
            entry = out.setdefault(name, {"spec": TableSpec.from_dict(t["spec"]), "ids": [],
                                          "weights": [], "state": {}, "fill": {},
                                          "partial": False, "clocks": []})
            entry["partial"] = entry["partial"] or bool(t.get("partial"))
            entry["clocks"].append(t["clocks"].numpy() if "clocks" in t else None)
            entry["ids"].append(t["ids"].numpy())
            entry["weights"].append(t["weights"])
            for k, v in t["state"].items():
                entry["state"].setdefault(k, []).append(v)
            entry["fill"].update(t["state_fill"])
    for entry in out.values():
        one = len(entry["ids"]) == 1   # one shard: its tensors as they are, not a copy
        ids = entry["ids"][0] if one else np.concatenate(entry["ids"])
        weights = entry["weights"][0] if one else torch.cat(entry["weights"])
        state = {k: v[0] if one else torch.cat(v) for k, v in entry["state"].items()}
        parts = entry["clocks"]
        clocks = None if any(c is None for c in parts) else \
            parts[0] if one else np.concatenate(parts)
        if (ids < 0).any():   # evicted slots (tombstones): not rows
            live = torch.from_numpy(np.flatnonzero(ids >= 0))
            ids, weights = ids[live.numpy()], weights.index_select(0, live)
            state = {k: v.index_select(0, live) for k, v in state.items()}
            clocks = None if clocks is None else clocks[live.numpy()]
        entry["ids"], entry["weights"], entry["state"] = ids, weights, state
        entry["clocks"] = clocks
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
        if spec.explicit and t["partial"]:   # admission/eviction: a missing row is zeros
            full = torch.zeros((spec.num_embeddings, spec.dim), dtype=spec.dtype)
        elif spec.explicit:  # every row was pushed and checkpointed
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
