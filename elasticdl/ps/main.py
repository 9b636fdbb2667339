"""Entry point of a parameter-server process.

``python -m elasticdl.ps.main --ps_id=I --num_ps=N --port=P --job_spec=JSON
[--master_addr=host:port] [--checkpoint_dir_for_init=DIR]``

Loads the model module named by the job spec (for its ``optimizer``),
restores this PS's shard from ``--restore_from`` (the master's restore rule,
:mod:`elasticdl.checkpoint.restore`: exactly that version directory, or ``none``;
the number of PS may differ from the checkpoint's), serves until
SIGTERM/SIGINT, and writes its shard every ``--checkpoint_steps`` versions. A
PS started without ``--restore_from`` (by hand, without a master) restores the
init checkpoint, else its checkpoint directory's newest version.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from elasticdl.api.model_spec import load_from_job_spec
from elasticdl.checkpoint import api as ckpt_api
from elasticdl.checkpoint import staging
from elasticdl.common import auth, faults
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.log_utils import configure_logging
from elasticdl.common.malloc import PS_MALLOC_ARENAS, release_free_heap_every, tune_malloc
from elasticdl.common.schedule import Schedule
from elasticdl.ps import shard_checkpoint as shard_ckpt
from elasticdl.ps.audit import AuditLog
from elasticdl.ps.eviction import EmbeddingDefaults
from elasticdl.ps.server import start_server
from elasticdl.ps.servicer import PServicer
from elasticdl.ps.shard import PSShard, ShardConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PSArgs:
    """The flags of a PS process."""

    ps_id: int
    num_ps: int
    port: int
    job_spec: JobSpec
    master_addr: str = ""
    checkpoint_dir_for_init: str = ""
    host: str = "0.0.0.0"
    sync_wait_s: float = 30.0
    sync_wait_min_s: float = 1.0
    grace_s: float = 2.0
    await_rollback: bool = False
    restore_from: Optional[str] = None   # a version dir, "none", or None: the standalone rule
    version_floor: int = 0               # versions continue above this (the run's base)

    def __post_init__(self) -> None:
        if not 0 <= self.ps_id < self.num_ps:
            raise ValueError(f"--ps_id={self.ps_id} out of range for --num_ps={self.num_ps}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port={self.port} out of range")


def parse_args(argv: Optional[Sequence[str]] = None) -> PSArgs:
    p = argparse.ArgumentParser(prog="python -m elasticdl.ps.main", description=__doc__)
    p.add_argument("--ps_id", type=int, required=True)
    p.add_argument("--num_ps", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="0 picks a free port")
    p.add_argument("--job_spec", required=True, help="the JobSpec as JSON, or @FILE")
    p.add_argument("--master_addr", default="")
    p.add_argument("--checkpoint_dir_for_init", default="")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--sync_wait_s", type=float, default=30.0,
                   help="sync mode: longest wait of a push for its group to be applied")
    p.add_argument("--sync_wait_min_s", type=float, default=1.0,
                   help="sync mode: shortest such wait (the wait adapts in between)")
    p.add_argument("--await_rollback", action="store_true",
                   help="a relaunched PS: serve training only after the master rolled every "
                        "PS back to one checkpoint version")
    p.add_argument("--restore_from", default=None,
                   help="the version directory to restore (the master's restore rule), or "
                        "'none' to start empty")
    p.add_argument("--version_floor", type=int, default=0,
                   help="continue numbering versions above this one (a run resumed from an "
                        "older version of its own checkpoint directory)")
    a = p.parse_args(argv)
    text = a.job_spec
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    return PSArgs(ps_id=a.ps_id, num_ps=a.num_ps, port=a.port, job_spec=JobSpec.from_json(text),
                  master_addr=a.master_addr, checkpoint_dir_for_init=a.checkpoint_dir_for_init,
                  host=a.host, sync_wait_s=a.sync_wait_s, sync_wait_min_s=a.sync_wait_min_s,
                  await_rollback=a.await_rollback, restore_from=a.restore_from,
                  version_floor=a.version_floor)


def shard_config(args: PSArgs) -> ShardConfig:
    spec = args.job_spec
    return ShardConfig(ps_id=args.ps_id, num_ps=args.num_ps, grads_to_wait=spec.grads_to_wait,
                       use_async=spec.use_async,
                       lr_staleness_modulation=spec.lr_staleness_modulation,
                       sync_version_tolerance=spec.sync_version_tolerance,
                       sync_wait_s=args.sync_wait_s, sync_wait_min_s=args.sync_wait_min_s,
                       checkpoint_dir=spec.checkpoint_dir,
                       checkpoint_steps=spec.checkpoint_steps,
                       keep_checkpoint_max=spec.keep_checkpoint_max,
                       full_checkpoint_every=spec.full_checkpoint_every,
                       minibatch_size=spec.minibatch_size,
                       embedding=EmbeddingDefaults(
                           admit_after=spec.embedding_admit_after,
                           ttl_versions=spec.embedding_ttl_versions,
                           ttl_seconds=spec.embedding_ttl_seconds,
                           max_rows=spec.embedding_max_rows,
                           sketch_counters=spec.embedding_admission_counters,
                           sweep_rows=spec.embedding_evict_sweep_rows))


def checkpoint_every_n(shard: PSShard) -> None:
    """``on_version`` hook: write the shard every ``checkpoint_steps`` versions (the
    job's one :class:`Schedule` rule; every PS applies versions one by one, so all
    PS write the same versions). Called under the shard lock: the checkpoint is cut
    there (milliseconds) and written in the background. A fault point after a version
    fires once the checkpoints cut so far are on disk, so a test's kill "after version
    N" follows the checkpoints up to N, as when they were written in place, and so does
    the audit trail of applied pushes (what a test reads the redo from)."""
    cfg = shard.config
    schedule = Schedule(checkpoint_steps=cfg.checkpoint_steps if cfg.checkpoint_dir else 0)
    if schedule.checkpoint_due(shard.version, shard.last_checkpoint_version):
        shard_ckpt.save_shard(shard, cfg.checkpoint_dir, shard.version, cfg.keep_checkpoint_max,
                              wait=False)
    if faults.armed("after_version"):
        shard_ckpt.flush_under_lock(shard)
        if shard.audit is not None:
            shard.audit.flush()
    faults.point("after_version")


def initial_checkpoint(shard: PSShard) -> None:
    """``on_model_pushed`` hook under ``--on_divergence=rollback``: the model a worker
    pushed is written at once (version 0 in a new job), so a model that collapses in
    its first steps, before the first periodic checkpoint, has a checkpoint from before
    the collapse to roll back to (written in the background, as every checkpoint)."""
    cfg = shard.config
    if cfg.checkpoint_dir and cfg.checkpoint_steps and \
            getattr(shard.job_spec, "on_divergence", "") == "rollback":
        shard_ckpt.save_shard(shard, cfg.checkpoint_dir, shard.version, cfg.keep_checkpoint_max,
                              wait=False)


def restore_source(args: PSArgs) -> Optional[str]:
    """The version dir to restore from: ``--restore_from`` (the master's rule); for
    a PS started without it, the init checkpoint (an explicit version directory
    means that version), else the job's own newest checkpoint."""
    if args.restore_from is not None:
        return None if args.restore_from == "none" else staging.to_local(args.restore_from)
    init = args.checkpoint_dir_for_init or args.job_spec.checkpoint_dir_for_init
    if init:
        return staging.to_local(init)
    return ckpt_api.latest(args.job_spec.checkpoint_dir)


def build_shard(args: PSArgs) -> PSShard:
    model_spec = load_from_job_spec(args.job_spec)
    shard = PSShard(shard_config(args), model_spec, on_version=checkpoint_every_n)
    shard.job_spec = args.job_spec
    shard.on_model_pushed = initial_checkpoint
    output = args.job_spec.output
    if output:  # the full history of applied pushes, on disk only (ps/audit.py)
        shard.audit = AuditLog(os.path.join(output, f"ps-{args.ps_id}-applied.bin"))
    source = restore_source(args)
    if source:
        shard_ckpt.restore_from(shard, source)
    elif shard.audit is not None and not args.await_rollback:
        shard.audit.clear()   # a new job: no history yet
    if args.version_floor > shard.version:
        with shard.lock:   # versions of this run never repeat an earlier run's numbers
            shard.params.version = shard.last_checkpoint_version = args.version_floor
    shard.awaiting_rollback = args.await_rollback
    return shard


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    configure_logging(args.job_spec.log_level, role=f"ps-{args.ps_id}")
    faults.set_role(f"ps-{args.ps_id}")
    tune_malloc(PS_MALLOC_ARENAS)
    # checkpoint URLs: this pod's own staging directory, kept in step with the bucket
    args = dataclasses.replace(args, job_spec=staging.stage_pod(args.job_spec,
                                                                f"ps-{args.ps_id}"))
    try:
        return _serve(args)
    finally:
        staging.stop_all(quiet=True)   # the checkpoints written before the stop go up


def _serve(args: PSArgs) -> int:
    shard = build_shard(args)
    job_secrets = auth.JobSecrets.from_env()
    if job_secrets is None:
        logger.warning("no %s in the environment: this PS serves WITHOUT authentication "
                       "(every replica the elasticdl launcher starts has one)", auth.TOKEN_ENV)
    server, port = start_server(PServicer(shard), args.port, args.host,
                                job_secrets=job_secrets)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("PS %d got signal %d; stopping", args.ps_id, signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    message = f"PS {args.ps_id} serving on port {port}"
    print(message, flush=True)
    logger.info("%s (pid %d, master %s, version %d, initialised %s)", message, os.getpid(),
                args.master_addr or "-", shard.version, shard.initialized)
    if args.master_addr:  # a PS whose master is gone for good exits
        from elasticdl.ps.master_watch import watch_master

        watch_master(args.master_addr, f"ps-{args.ps_id}", stop,
                     args.job_spec.master_reconnect_timeout_s)
        if not shard.config.use_async and shard.config.grads_to_wait > 1:
            from elasticdl.ps.group_size import follow_job_size

            follow_job_size(args.master_addr, f"ps-{args.ps_id}", shard, stop)
    release_free_heap_every(stop, name=f"PS {args.ps_id}")   # a burst's freed heap pages
    while not stop.wait(1.0):
        pass
    server.stop(args.grace_s).wait(args.grace_s + 1)
    shard_ckpt.flush(shard)   # the checkpoints cut before the stop
    logger.info("PS %d stopped at version %d", args.ps_id, shard.version)
    write_ledger(shard, args.job_spec.output)
    return 0


def write_ledger(shard: PSShard, output: str) -> None:
    """``output/ps-<i>-ledger.json``: the applied-identity ledger at the end (audits)."""
    if not output:
        return
    version, entries = shard.applied()
    with shard.lock:
        live, closed = len(shard.ledger), shard.ledger.closed.to_flat()
    # every push of the model's history (the on-disk audit trail), streamed; without
    # one, the live entries
    rows = shard.audit.entries() if shard.audit is not None else iter(entries)
    os.makedirs(output, exist_ok=True)
    path = os.path.join(output, f"ps-{shard.config.ps_id}-ledger.json")
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        head = json.dumps({"version": version, "duplicates_ignored": shard.duplicates_ignored,
                           "live_pushes": live, "closed": closed})
        f.write(head[:-1] + ', "applied": [')
        for row in rows:
            f.write((", " if n else "") + json.dumps(list(row)))
            n += 1
        f.write("]}")
    logger.info("PS %d wrote its ledger (%d applied pushes) to %s", shard.config.ps_id, n,
                path)


if __name__ == "__main__":
    sys.exit(main())
