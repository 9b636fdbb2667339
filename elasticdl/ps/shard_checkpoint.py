"""Saving and restoring one PS shard in the PS checkpoint format
(:mod:`elasticdl.checkpoint.ps_shards`: one ``torch.save`` file per PS).

Each PS writes its own file; after writing, a PS that sees all ``n`` files marks the version
done (whichever finishes last; marking twice is harmless) and applies retention. A restore
reads every shard of the version and keeps what the restoring PS owns under the *new*
placement (dense by name hash, rows by ``id % num_ps``), so the number of PS may change
between save and restore.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import numpy as np
import torch

from elasticdl.checkpoint import data_position, paths
from elasticdl.checkpoint import single as ckpt
from elasticdl.checkpoint.ps_shards import load_shards, shard_path, tables_of
from elasticdl.common import ledger as ps_ledger
from elasticdl.common.intervals import IntervalSet
from elasticdl.common.tables import dense_owner
from elasticdl.ps.shard import PSShard

logger = logging.getLogger(__name__)


def save_shard(shard: PSShard, checkpoint_dir: str, version: Optional[int] = None,
               keep_max: int = 0) -> str:
    """Write this PS's shard as ``version`` (default: its current version).

    Returns the shard file's path. The version becomes complete (DONE) once
    every PS of the job wrote its file.
    """
    state = shard.state_dict()
    if version is None or version < 0:
        version = int(state["version"])
    state["optimizer_by_name"] = _optimizer_by_name(state)
    n = shard.config.num_ps
    vdir = ckpt.version_dir(checkpoint_dir, version)
    path = shard_path(vdir, shard.config.ps_id, n)
    mb = shard.config.minibatch_size
    if mb > 0:  # the data position: which records these parameters were trained on
        led = state["ledger"]
        data_position.write_trained_compact(
            vdir, f"ps-{shard.config.ps_id}-of-{n}", int(led.get("generation", -1)),
            IntervalSet.from_flat(led["closed"].tolist()),
            ((task, (k - 1) * mb, records) for task, k, records, _ in led["log"].tolist()))
    ckpt.save_file(state, path)
    shard.last_checkpoint_version = max(shard.last_checkpoint_version, version)
    if all(os.path.exists(shard_path(vdir, i, n)) for i in range(n)):
        ckpt.mark_done(checkpoint_dir, version, keep_max)
        logger.info("checkpoint version %d complete (%d shards) in %s", version, n, vdir)
    else:
        logger.info("PS %d wrote %s", shard.config.ps_id, path)
    return path


def _optimizer_by_name(state: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Per-parameter optimizer state keyed by parameter name (for re-partitioning)."""
    opt = state.get("optimizer")
    if not opt:
        return None
    trainable = [n for n in state["dense_order"] if state["dense"][n].dtype.is_floating_point]
    groups = opt["param_groups"]
    if len(groups) != 1:
        return None  # only a single group can be split across a different number of PS
    by_index = dict(zip(groups[0]["params"], trainable))
    hyper = {k: v for k, v in groups[0].items() if k != "params"}
    return {"hyper": hyper, "state": {by_index[i]: s for i, s in opt["state"].items()}}


def restore_shard(shard: PSShard, version_dir: str) -> int:
    """Initialise ``shard`` from a checkpoint written by any number of PS.

    Returns the restored model version.
    """
    shards = load_shards(version_dir)
    cfg = shard.config
    # the directory names the version (a sync job's final checkpoint may hold a shard
    # written by a PS whose count of applied updates was lower: PS versions parted)
    try:
        version = paths.version_of(version_dir)
    except ckpt.CheckpointError:   # not a version-N directory (a copy of the files)
        version = int(shards[0]["version"])
    same_layout = len(shards) == cfg.num_ps
    dense: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    for s in shards:
        for name in s["dense_order"]:
            if dense_owner(name, cfg.num_ps) == cfg.ps_id:
                dense[name] = s["dense"][name]
        for name, value in s["buffers"].items():
            if dense_owner(name, cfg.num_ps) == cfg.ps_id:
                buffers[name] = value
    opt_state = shards[cfg.ps_id]["optimizer"] if same_layout else \
        _regroup_optimizer(shards, dense)
    tables = tables_of(shards)
    # the ledger says which pushes these parameters contain; with a different
    # number of PS a push is in the restored state only if every old shard has it
    ledger = shards[cfg.ps_id].get("ledger") if same_layout else _common_ledger(shards)
    # the learning-rate schedule (and the epoch it is at) is the same on every PS
    schedule = shards[cfg.ps_id if same_layout else 0].get("lr_schedule")
    if not shard.initialize(version, dense, buffers, [t["spec"] for t in tables.values()],
                            optimizer_state=opt_state, ledger=ledger,
                            lr_schedule_state=schedule):
        raise ckpt.CheckpointError(f"PS {cfg.ps_id} is already initialised; cannot restore "
                                   f"{version_dir}")
    with shard.lock:
        for name, t in tables.items():
            mine = t["ids"] % cfg.num_ps == cfg.ps_id
            idx = torch.from_numpy(np.nonzero(mine)[0])
            shard.params.tables[name].load_rows(
                t["ids"][mine], t["weights"].index_select(0, idx),
                {k: v.index_select(0, idx) for k, v in t["state"].items()}, t["fill"])
    logger.info("PS %d restored version %d from %s (%d shards -> %d PS)", cfg.ps_id, version,
                version_dir, len(shards), cfg.num_ps)
    return version


def _common_ledger(shards: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """What every old shard's ledger holds (closed on all, or held by each)."""
    logs = [s["ledger"] for s in shards if s.get("ledger") is not None]
    if len(logs) != len(shards):
        return None
    parts = []
    versions: dict[tuple[int, int], int] = {}
    for log in logs:
        closed = IntervalSet.from_flat(log["closed"].tolist()) \
            if log.get("closed") is not None else IntervalSet()
        rows = log["log"].tolist()
        for t, mb, _, v in rows:
            versions[(t, mb)] = max(versions.get((t, mb), 0), v)
        parts.append(ps_ledger.held(closed, ((t, mb, r) for t, mb, r, _ in rows)))
    closed, live = ps_ledger.common(parts)
    rows = sorted(((t, mb, r, versions[(t, mb)]) for t, mbs in live.items()
                   for mb, r in mbs.items()), key=lambda row: row[3])
    return {"log": torch.tensor(rows, dtype=torch.int64).reshape(-1, 4),
            "closed": torch.tensor(closed.to_flat(), dtype=torch.int64)}


def _regroup_optimizer(shards: list[dict[str, Any]],
                       dense: dict[str, torch.Tensor]) -> Optional[dict[str, Any]]:
    by_name: dict[str, Any] = {}
    hyper: Optional[dict[str, Any]] = None
    for s in shards:
        part = s.get("optimizer_by_name")
        if s.get("optimizer") and part is None:
            logger.warning("optimizer state with several param groups cannot be "
                           "re-partitioned; dense optimizer state starts fresh")
            return None
        if part:
            hyper = part["hyper"]
            by_name.update(part["state"])
    trainable = [n for n, t in dense.items() if t.dtype.is_floating_point]
    if hyper is None or not trainable:
        return None
    return {"state": {i: by_name[n] for i, n in enumerate(trainable) if n in by_name},
            "param_groups": [{**hyper, "params": list(range(len(trainable)))}]}
