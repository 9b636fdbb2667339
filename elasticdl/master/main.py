"""The master process: ``python -m elasticdl.master.main --job_spec=JSON ...``.

Builds the task manager from the job's data, serves the Master gRPC service,
launches PS and workers through the cluster backend and runs the job
controller until the job ends. Exit code 0 when the job succeeded, 1 when it
failed, 2 on bad arguments. Never imports torch (a custom data reader from the
model module is the one exception: it is imported only when the built-in
readers cannot read the data).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Optional

from elasticdl.api import dataset_probe
from elasticdl.checkpoint import data_position, restore, staging
from elasticdl.checkpoint import paths as ckpt_paths
from elasticdl.cluster.registry import create_cluster
from elasticdl.common import auth, faults
from elasticdl.common.enums import JobType
from elasticdl.common.job_spec import JobSpec, JobSpecError
from elasticdl.common.log_utils import configure_logging
from elasticdl.common.strategy import entry_for
from elasticdl.data.api import DataError
from elasticdl.data.csv_reader import INDEX_CACHE_ENV
from elasticdl.data.datasets import create_readers, master_readers
from elasticdl.master import failover, job_history, observability, ps_settle
from elasticdl.master.job import JobCore
from elasticdl.master.job_controller import JobController
from elasticdl.master.job_factory import core_from_spec, report_for, start_version_of
from elasticdl.master.journal import JournalLockedError
from elasticdl.master.rendezvous import RendezvousHandler
from elasticdl.master.scaling import WorkerCounts
from elasticdl.master.servicer import MasterServicer, start_master_server
from elasticdl.master.training_health import SUCCEEDED_WITH_WARNINGS

logger = logging.getLogger("elasticdl.master")


@dataclass(frozen=True)
class MasterArgs:
    job_spec: JobSpec
    port: int
    job_dir: str
    host: str
    restore: bool = False


def parse_args(argv: Optional[list[str]] = None) -> MasterArgs:
    p = argparse.ArgumentParser(prog="elasticdl.master.main")
    p.add_argument("--job_spec", required=True, help="the JobSpec as JSON")
    p.add_argument("--port", type=int, default=50001)
    p.add_argument("--job_dir", default="", help="job directory (default: --output or "
                   "~/.elasticdl/jobs/<job>)")
    p.add_argument("--host", default="", help="address replicas dial (default: $MY_POD_IP "
                   "or 127.0.0.1)")
    p.add_argument("--restore", action="store_true",
                   help="a relaunched master: continue the job from the journal in the job "
                        "directory (if there is one) and adopt the replicas still running; "
                        "without it an old journal there is discarded")
    a = p.parse_args(argv)
    try:
        spec = JobSpec.from_json(a.job_spec)
    except (JobSpecError, ValueError) as e:
        p.error(f"--job_spec: {e}")
    if not 0 < a.port < 65536:
        p.error(f"--port: must be in 1..65535, got {a.port}")
    from elasticdl.common.job_dirs import job_dir_for

    job_dir = a.job_dir or job_dir_for(spec)
    host = a.host or os.environ.get("MY_POD_IP", "127.0.0.1")
    return MasterArgs(spec, a.port, job_dir, host, a.restore)


def _readers(spec: JobSpec) -> dict:
    # a module's dataset(path, mode): sized by a probe subprocess
    readers = master_readers(spec, dataset_probe.command())
    if readers:
        return readers
    try:
        return create_readers(spec)
    except DataError:
        from elasticdl.api.model_spec import load_from_job_spec

        model_spec = load_from_job_spec(spec)
        if model_spec.dataset is not None:   # defined in a way the source check missed
            return master_readers(spec, dataset_probe.command(), defined=True)
        if model_spec.custom_data_reader is None:
            raise
        return create_readers(spec, model_spec.custom_data_reader)


def build_core(spec: JobSpec, restoring: bool = False) -> JobCore:
    """The job core for this run (tasks from the job's data, schedule, report);
    ``restoring``: its state comes from the journal next (no data position to
    resume, the task table of the run is appended to)."""
    start = 0
    if spec.job_type == JobType.TRAIN and not restoring:
        ckpt_paths.check_fresh_checkpoint_dir(spec.checkpoint_dir, spec.checkpoint_dir_for_init)
    if spec.checkpoint_dir_for_init:  # the version workers load (train, evaluate, predict)
        start = start_version_of(spec.checkpoint_dir_for_init)
        if spec.job_type == JobType.TRAIN and entry_for(spec.distribution_strategy).num_ps(spec):
            # PS versions of a run resumed from an older version of its own directory
            # continue above that directory's newest (see master/restore.py)
            start = max(start, restore.run_base(spec))
    # a new task id range per run: no task matches a PS ledger of an earlier run
    core = core_from_spec(spec, _readers(spec), first_task_id=int(time.time() * 1000) << 16,
                          start_version=start)
    # the worker bounds, before a restore: replayed resizes land in it (docs/elastic.md)
    core.attachments["scaling"] = WorkerCounts(spec.workers_min, spec.initial_workers)
    if spec.job_type == JobType.TRAIN and not restoring:
        # resume the data position; record this run's tasks. PS restore their own
        # shard's ledger: a task they hold differently resumes under its own id
        num_ps = entry_for(spec.distribution_strategy).num_ps(spec)
        data_position.attach(core.tm, spec.checkpoint_dir, spec.checkpoint_dir_for_init,
                             data_position.Carry(num_ps, spec.minibatch_size) if num_ps else None)
    return core


def _rendezvous(spec: JobSpec, host: str) -> Optional[RendezvousHandler]:
    if not entry_for(spec.distribution_strategy).rendezvous_needed(spec):
        return None
    from elasticdl.cluster.process import free_port
    from elasticdl.master.rendezvous import Rendezvous

    # after a failure, healthy members abandon the plan and check in within about a
    # second (they poll it while they wait); one silent for longer than a collective
    # timeout (+2 s: a member blocked in a collective reports when that times out) is hung
    return Rendezvous(host, free_port, checkin_timeout_s=spec.collective_timeout_s + 5,
                      initial_workers=spec.workers_min,
                      hung_after_s=spec.collective_timeout_s + 2)


def run_master(args: MasterArgs, stop: Optional[threading.Event] = None) -> int:
    try:
        return _run_master(args, stop)
    finally:
        staging.stop_all(quiet=True)   # the task table and history up, after the last version


def _run_master(args: MasterArgs, stop: Optional[threading.Event] = None) -> int:
    # checkpoint URLs: this pod's own staging directory, kept in step with the bucket
    args = dataclasses.replace(args, job_spec=staging.stage_pod(args.job_spec, "master"))
    spec = args.job_spec
    os.makedirs(args.job_dir, exist_ok=True)
    report_dir = spec.output or args.job_dir
    # the job's token (and TLS cert): from the launcher, else made here; every
    # replica gets it (local children inherit the environment, pods a Secret)
    job_secrets = auth.ensure_job_secrets(args.job_dir, spec.grpc_tls)
    os.environ.update(job_secrets.env())
    journal, restoring = failover.open_journal(args.job_dir, args.restore)
    # line indexes of CSV/text data kept in the job directory: a restarted master reuses them
    os.environ.setdefault(INDEX_CACHE_ENV, os.path.join(args.job_dir, "data_index"))
    core = build_core(spec, restoring)
    # allreduce: only a member that trained holds the final model to export
    core.export_requires_training = entry_for(spec.distribution_strategy).rendezvous_needed(
        spec)
    report = core.report
    if restoring:
        core.restore(journal)
        failover.reopen_task_table(core, spec)
        job_history.attach(core, spec, restoring=True)
    else:
        # a resumed job's report covers the whole job (the checkpoint's history)
        job_history.attach(core, spec)
        core.attach_journal(journal)
        core.begin()
        if spec.checkpoint_dir_for_init:
            core.snapshot()
    if spec.checkpoint_dir:   # staged: the task table up before its tasks are handed out
        staging.flush(spec.checkpoint_dir)
        core.tm.block_created_callbacks.append(lambda *_: staging.flush(
            spec.checkpoint_dir, quiet=True))
    core.new_incarnation()   # the steps this master takes, and its RPCs, carry it
    in_pod = spec.cluster == "k8s"  # TensorBoard files and /metrics (docs/observability.md)
    obs = observability.attach(core, spec.output, spec.master_metrics_port(args.port),
                               "0.0.0.0" if in_pod else args.host, args.host, track_ps=True,
                               fresh=not restoring)
    observability.publish(obs, args.job_dir, report)
    cluster = create_cluster(spec.cluster, spec, args.job_dir)
    rendezvous = _rendezvous(spec, args.host)
    if rendezvous is not None:
        core.attachments["rendezvous"] = rendezvous
        if core.restored_extra.get("rendezvous"):
            rendezvous.load_state_dict(core.restored_extra["rendezvous"])
    master_addr = cluster.master_address() or f"{args.host}:{args.port}"
    controller = JobController(spec, cluster, core, master_addr, report_dir,
                               rendezvous=rendezvous)
    servicer = MasterServicer(core, rendezvous, require_identity=True)
    server = start_master_server(servicer, args.port, job_secrets=job_secrets)
    stop = stop or threading.Event()
    settler = None
    try:
        if restoring:
            failover.take_over(controller, cluster, args.job_dir)
        else:
            controller.start()
        # the PS learn which tasks are closed: their ledgers stay O(live)
        settler = ps_settle.start(core, controller.ps_addrs, spec.checkpoint_dir)
        status = controller.run(stop)
    except Exception as e:  # the report must never stay "running" after the master dies
        logger.exception("master failed")
        report.fail("master", f"{type(e).__name__}: {e}", traceback.format_exc())
        report.write(report_dir)
        raise
    finally:
        if settler is not None:
            settler.stop()
        obs.stop_endpoint()
        cluster.close()
        server.stop(grace=2).wait(5)
        obs.close()
        journal.close()
    return 0 if status in ("succeeded", SUCCEEDED_WITH_WARNINGS) else 1


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    configure_logging(args.job_spec.log_level, role="master")
    faults.set_role("master")
    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        logger.warning("signal %d: stopping job %s", signum, args.job_spec.job_name)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        return run_master(args, stop)
    except JournalLockedError as e:   # the job is another master's: leave its report alone
        logger.error("cannot start job: %s", e)
        return 1
    except (DataError, ckpt_paths.CheckpointError, auth.AuthError,
            observability.ObservabilityError) as e:
        logger.error("cannot start job: %s", e)
        report_for(args.job_spec, status="failed",
                   failure={"replica": "master", "error": str(e), "traceback": ""}
                   ).write(args.job_spec.output or args.job_dir)
        return 1


if __name__ == "__main__":
    sys.exit(main())
