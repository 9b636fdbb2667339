"""Saving and restoring one PS shard in the PS checkpoint format
(:mod:`elasticdl.checkpoint.ps_shards`: one ``torch.save`` file per PS, whole or a delta).

A checkpoint is *cut* under the shard lock in milliseconds (dense parameters, optimizer and
schedule state, ledger, version, and which rows: all, or those changed since the previous
cut) and *written* by the shard's background writer, which copies the rows chunk by chunk
(copy-on-write keeps them as they were at the cut, :mod:`elasticdl.ps.row_snapshot`).

Each PS writes its own file; after writing, a PS that sees all ``n`` files marks the version
done (whichever finishes last; marking twice is harmless) and applies retention. A restore
reads every shard of the version and keeps what the restoring PS owns under the *new*
placement (dense by name hash, rows by ``id % num_ps``), so the number of PS may change
between save and restore.
"""

from __future__ import annotations

import copy
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from elasticdl.checkpoint import data_position, paths, staging
from elasticdl.checkpoint import single as ckpt
from elasticdl.checkpoint.ps_shards import (
    load_shard,
    load_shards,
    mark_done,
    shard_count,
    shard_path,
    tables_of,
    write_delta_note,
)
from elasticdl.common import ledger as ps_ledger
from elasticdl.common.intervals import IntervalSet
from elasticdl.common.tables import dense_owner
from elasticdl.ps.row_snapshot import CheckpointChain, TableSnapshot
from elasticdl.ps.shard import NotInitializedError, PSShard

logger = logging.getLogger(__name__)

CHUNK_PAUSE_S = 0.0005   # between two chunk copies, outside the lock


def save_shard(shard: PSShard, checkpoint_dir: str, version: Optional[int] = None,
               keep_max: int = 0, wait: bool = True) -> str:
    """Write this PS's shard as ``version`` (default: its current version).

    The state is cut at once (:func:`cut`: the shard lock is held for milliseconds) and
    written by the shard's background writer; with ``wait`` this returns once the file
    is written, else at once (the periodic checkpoint, called under the shard lock).
    Returns the shard file's path. The version becomes complete (DONE) once every PS of
    the job wrote its file.

    Raises:
        NotInitializedError: the PS has no model.
        CheckpointError, OSError: (``wait``) the write failed; the next checkpoint is whole.
    """
    job = cut(shard, checkpoint_dir, version, keep_max)
    with shard.lock:
        if shard.checkpoint_writer is None:
            shard.checkpoint_writer = CheckpointWriter(shard)
        writer = shard.checkpoint_writer
    done = writer.submit(job)
    return done.result() if wait else job.path


def flush(shard: PSShard, timeout_s: Optional[float] = None) -> None:
    """Wait until every checkpoint cut so far is written (or failed)."""
    writer = shard.checkpoint_writer
    if writer is not None:
        writer.flush(timeout_s)


def flush_under_lock(shard: PSShard, timeout_s: float = 600.0) -> None:
    """:func:`flush` from a thread holding the shard lock: it waits on the lock's
    condition, which lets the writer take the lock for its copy meanwhile."""
    writer = shard.checkpoint_writer
    if writer is None:
        return
    marker = writer.submit(None)  # type: ignore[arg-type]
    deadline = time.monotonic() + timeout_s
    while not marker.done() and time.monotonic() < deadline:
        shard.lock.wait(0.05)


@dataclass
class Cut:
    """What one checkpoint holds, captured at one moment: everything but the rows, and
    per table the :class:`TableSnapshot` that copies its rows as they were then."""

    checkpoint_dir: str
    version: int
    keep_max: int
    head: dict[str, Any]
    tables: dict[str, tuple[dict[str, Any], dict[str, float], TableSnapshot]]
    delta: Optional[dict[str, int]]   # {"prev_version", "full_version"}; None: whole
    cut_s: float = 0.0                # the shard lock held for the cut
    started: float = 0.0

    @property
    def vdir(self) -> str:
        return ckpt.version_dir(self.checkpoint_dir, self.version)

    @property
    def path(self) -> str:
        return shard_path(self.vdir, int(self.head["ps_id"]), int(self.head["num_ps"]))


def cut(shard: PSShard, checkpoint_dir: str, version: Optional[int] = None,
        keep_max: int = 0) -> Cut:
    """The consistent state of ``shard`` now (under its lock, for milliseconds: the
    rows are copied afterwards, copy-on-write, :mod:`elasticdl.ps.row_snapshot`). Every
    ``full_checkpoint_every``-th cut of a chain is whole; the others hold the rows
    changed since the previous cut."""
    cfg = shard.config
    with shard.lock:
        started = time.monotonic()
        if not shard.initialized:
            raise NotInitializedError(f"PS {cfg.ps_id} has no model yet (push_model)")
        if shard.audit is not None:   # what this checkpoint holds is on disk
            shard.audit.flush()
        p = shard.params
        at = p.version if version is None or version < 0 else int(version)
        chain = shard.chain
        full = chain.last_version is None or chain.full_version is None or \
            chain.last_version >= at or chain.since_full >= cfg.full_checkpoint_every
        head = {
            "version": p.version, "ps_id": p.ps_id, "num_ps": p.num_ps,
            "dense": {n: t.detach().clone() for n, t in p.dense.items()},
            "buffers": {n: t.clone() for n, t in p.buffers.items()},
            "optimizer": copy.deepcopy(shard.optimizer.state_dict()) if shard.optimizer
            else None,
            "dense_order": list(p.dense),
            "ledger": shard.ledger.state_dict(),
            "lr_schedule": shard.schedule.state_dict() if shard.schedule else None,
        }
        tables = {n: (t.spec.to_dict(), t.state_fill, t.cut(full)) for n, t in p.tables.items()}
        delta = None if full else {"prev_version": int(chain.last_version or 0),
                                   "full_version": int(chain.full_version or 0)}
        if full:
            chain.full_version, chain.since_full = at, 1
        else:
            chain.since_full += 1
        chain.last_version = at
        shard.last_checkpoint_version = max(shard.last_checkpoint_version, at)
        cut_s = time.monotonic() - started
    return Cut(checkpoint_dir, at, keep_max, head, tables, delta, cut_s, started)


class CheckpointWriter:
    """One background thread per PS: copies each cut's rows (a chunk at a time under the
    shard lock) and writes the file, the cuts in their order."""

    def __init__(self, shard: PSShard):
        self._shard = shard
        self._queue: queue.Queue[tuple[Cut, Future]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"ps-{shard.config.ps_id}-checkpoint")
        self._thread.start()

    def submit(self, job: Cut) -> Future:
        done: Future = Future()
        self._queue.put((job, done))
        return done

    def flush(self, timeout_s: Optional[float] = None) -> None:
        marker = self.submit(None)  # type: ignore[arg-type]
        try:
            marker.result(timeout_s)
        except FutureTimeout:
            logger.warning("PS %d: checkpoints still being written after %s s",
                           self._shard.config.ps_id, timeout_s)

    def _run(self) -> None:
        while True:
            job, done = self._queue.get()
            if job is None:
                done.set_result(None)
                continue
            try:
                done.set_result(self._write(job))
            except BaseException as e:  # noqa: BLE001 - handed to the waiter, logged here
                logger.error("PS %d: checkpoint version %d failed: %s; the next one is "
                             "whole", self._shard.config.ps_id, job.version, e)
                with self._shard.lock:
                    self._shard.chain = CheckpointChain()
                done.set_exception(e)

    def _copy_rows(self, job: Cut) -> float:
        """Copy every table's rows; returns the longest time one chunk held the lock."""
        shard = self._shard
        longest = 0.0
        for _, _, snap in job.tables.values():
            while True:
                with shard.lock:
                    start = time.monotonic()
                    snap.copy_chunk()
                    finished = snap.done
                    if finished and snap.table.snapshot is snap:
                        snap.table.snapshot = None
                    longest = max(longest, time.monotonic() - start)
                if finished:
                    break
                # let the pushes and pulls waiting for the lock in: the lock is not fair,
                # and this thread would otherwise take it back at once, chunk after chunk
                time.sleep(CHUNK_PAUSE_S)
        return longest

    def _write(self, job: Cut) -> str:
        chunk_s = self._copy_rows(job)
        state = dict(job.head)
        tables: dict[str, Any] = {}
        for name, (spec, fill, snap) in job.tables.items():
            entry: dict[str, Any] = {"spec": spec, "ids": torch.from_numpy(snap.ids),
                                     "weights": snap.weights, "state": snap.state,
                                     "state_fill": fill,
                                     "evicted": torch.from_numpy(
                                         snap.evicted if snap.evicted is not None
                                         else np.zeros(0, np.int64)),
                                     "evicted_complete": snap.evicted is not None,
                                     "partial": snap.partial}
            if snap.clocks is not None:
                entry["clocks"] = snap.clocks
            if job.delta is not None:
                assert snap.slots is not None
                entry["slots"] = torch.from_numpy(snap.slots)
                entry["size"] = snap.size
            tables[name] = entry
        state["tables"] = tables
        state["optimizer_by_name"] = _optimizer_by_name(state)
        ps_id, n = int(state["ps_id"]), int(state["num_ps"])
        vdir, path = job.vdir, job.path
        if job.delta is not None:
            state["delta"] = job.delta
            prev = shard_path(ckpt.version_dir(job.checkpoint_dir, job.delta["prev_version"]),
                              ps_id, n)
            if not os.path.exists(prev):
                raise ckpt.CheckpointError(f"{path}: the checkpoint it is a delta of, {prev}, "
                                           "is not there")
        mb = self._shard.config.minibatch_size
        if mb > 0:  # the data position: which records these parameters were trained on
            led = state["ledger"]
            data_position.write_trained_compact(
                vdir, f"ps-{ps_id}-of-{n}", int(led.get("generation", -1)),
                IntervalSet.from_flat(led["closed"].tolist()),
                ((task, (k - 1) * mb, records) for task, k, records, _ in
                 led["log"].tolist()))
        write_delta_note(vdir, ps_id, n, job.delta)
        ckpt.save_file(state, path)
        del state, tables
        for _, _, snap in job.tables.values():
            snap.release()   # a step at a time (row_arena.release): no long unmap
        if all(os.path.exists(shard_path(vdir, i, n)) for i in range(n)):
            mark_done(job.checkpoint_dir, job.version, job.keep_max)
            logger.info("checkpoint version %d complete (%d shards) in %s", job.version, n,
                        vdir)
        rows = sum(snap.rows for _, _, snap in job.tables.values())
        logger.info("PS %d wrote %s (%s, %d rows): the lock held %.1f ms for the cut, at "
                    "most %.1f ms per chunk copied; %.2f s in all", ps_id, path,
                    "a delta" if job.delta else "whole", rows, 1000 * job.cut_s,
                    1000 * chunk_s, time.monotonic() - job.started)
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


def restore_from(shard: PSShard, source: str) -> int:
    """:func:`restore_shard` from ``source``: a version directory, or a checkpoint
    directory (its newest complete version). A staged version (object storage) comes
    down before its ``DONE`` is checked: a relaunched pod holds only the newest complete
    version's small files, and a rollback may name an older one.

    Raises:
        CheckpointError: ``source`` holds nothing complete.
    """
    cfg = shard.config
    staging.ensure(source, f"ps-{cfg.ps_id}-of-{cfg.num_ps}.pt")
    return restore_shard(shard, paths.resolve(source))


def restore_shard(shard: PSShard, version_dir: str) -> int:
    """Initialise ``shard`` from a checkpoint written by any number of PS.

    Returns the restored model version.
    """
    cfg = shard.config
    # a staged checkpoint (object storage): the files this restore reads come down first
    staged_n = staging.ensure(version_dir, f"ps-{cfg.ps_id}-of-{cfg.num_ps}.pt")
    if staged_n == cfg.num_ps:    # only this PS's own shard came down
        vdir, n = ckpt.resolve(version_dir), cfg.num_ps
    else:
        vdir, n = shard_count(version_dir)
    same_layout = n == cfg.num_ps
    # the same number of PS: this PS's own file holds all it owns (its dense parameters
    # by name hash, its rows by id), and only that file is read
    shards = [load_shard(vdir, cfg.ps_id, n)] if same_layout else load_shards(vdir)
    own = shards[0] if same_layout else None
    # the directory names the version (a sync job's final checkpoint may hold a shard
    # written by a PS whose count of applied updates was lower: PS versions parted)
    try:
        version = paths.version_of(version_dir)
    except ckpt.CheckpointError:   # not a version-N directory (a copy of the files)
        version = int(shards[0]["version"])
    dense: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    for s in shards:
        for name in s["dense_order"]:
            if dense_owner(name, cfg.num_ps) == cfg.ps_id:
                dense[name] = s["dense"][name]
        for name, value in s["buffers"].items():
            if dense_owner(name, cfg.num_ps) == cfg.ps_id:
                buffers[name] = value
    opt_state = own["optimizer"] if own is not None else _regroup_optimizer(shards, dense)
    tables = tables_of(shards)
    # the ledger says which pushes these parameters contain; with a different
    # number of PS a push is in the restored state only if every old shard has it
    ledger = own.get("ledger") if own is not None else _common_ledger(shards)
    # the learning-rate schedule (and the epoch it is at) is the same on every PS
    schedule = shards[0].get("lr_schedule")
    if not shard.initialize(version, dense, buffers, [t["spec"] for t in tables.values()],
                            optimizer_state=opt_state, ledger=ledger,
                            lr_schedule_state=schedule):
        raise ckpt.CheckpointError(f"PS {cfg.ps_id} is already initialised; cannot restore "
                                   f"{version_dir}")
    with shard.lock:
        for name, t in tables.items():
            ids, weights, state, clocks = t["ids"], t["weights"], t["state"], t["clocks"]
            if not same_layout:   # (own rows: load_rows checks they are)
                mine = ids % cfg.num_ps == cfg.ps_id
                idx = torch.from_numpy(np.nonzero(mine)[0])
                ids, weights = ids[mine], weights.index_select(0, idx)
                state = {k: v.index_select(0, idx) for k, v in state.items()}
                clocks = None if clocks is None else clocks[mine]
            shard.params.tables[name].load_rows(ids, weights, state, t["fill"], clocks)
    logger.info("PS %d restored version %d from %s (%d shards -> %d PS)", cfg.ps_id, version,
                version_dir, n, cfg.num_ps)
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
