"""The worker process: ``python -m elasticdl.worker.main --worker_id=N ...``.

Builds the :class:`WorkerRuntime` the strategy registry names, runs it against
the master, and on the way out exports the final model when the master asks
this worker to. Its first exception is sent to the master (message and
traceback) before the process exits non-zero, so the job report names the
root cause.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from elasticdl.checkpoint import staging
from elasticdl.common import faults
from elasticdl.common.enums import JobType
from elasticdl.common.job_spec import JobSpec, JobSpecError
from elasticdl.common.log_utils import configure_logging

if TYPE_CHECKING:
    from elasticdl.worker.runtime import WorkerRuntime

logger = logging.getLogger("elasticdl.worker")

VERSION_REPORT_S = 5.0


@dataclass(frozen=True)
class WorkerArgs:
    worker_id: int
    master_addr: str
    job_spec: JobSpec
    ps_addrs: tuple[str, ...]
    host: str


def parse_args(argv: Optional[list[str]] = None) -> WorkerArgs:
    p = argparse.ArgumentParser(prog="elasticdl.worker.main")
    p.add_argument("--worker_id", type=int, required=True)
    p.add_argument("--master_addr", required=True, help="host:port of the master")
    p.add_argument("--job_spec", required=True, help="the JobSpec as JSON")
    p.add_argument("--ps_addrs", default="", help="host:port of each PS, comma separated")
    p.add_argument("--host", default="", help="address peers dial (allreduce); default "
                   "$MY_POD_IP or 127.0.0.1")
    a = p.parse_args(argv)
    if a.worker_id < 0:
        p.error(f"--worker_id must be >= 0, got {a.worker_id}")
    try:
        spec = JobSpec.from_json(a.job_spec)
    except (JobSpecError, ValueError) as e:
        p.error(f"--job_spec: {e}")
    ps = tuple(x for x in a.ps_addrs.split(",") if x)
    host = a.host or os.environ.get("MY_POD_IP", "127.0.0.1")
    return WorkerArgs(a.worker_id, a.master_addr, spec, ps, host)


def build_runtime(args: WorkerArgs, model_spec: Any, client: Any) -> WorkerRuntime:
    """The runtime registered for this job's strategy and type (:func:`runtime_class`)."""
    from elasticdl.worker.runtime import RuntimeContext, runtime_class

    ctx = RuntimeContext(model_spec, args.job_spec, args.worker_id, comm=client,
                         ps_addrs=args.ps_addrs, host=args.host)
    return runtime_class(args.job_spec).build(ctx)


def run_worker(args: WorkerArgs) -> int:
    from elasticdl.api.model_spec import load_from_job_spec
    from elasticdl.data.datasets import create_readers
    from elasticdl.worker.master_client import MasterClient
    from elasticdl.worker.prediction import PredictionSink

    spec = args.job_spec
    client = MasterClient(args.master_addr, args.worker_id,
                          unavailable_timeout_s=spec.master_reconnect_timeout_s)
    try:
        # checkpoint URLs: this pod's own staging directory, kept in step with the bucket
        args = dataclasses.replace(args, job_spec=staging.stage_pod(
            spec, f"worker-{args.worker_id}"))
        spec = args.job_spec
        model_spec = load_from_job_spec(spec)
        readers = create_readers(spec, model_spec.custom_data_reader, model_spec=model_spec)
        runtime = build_runtime(args, model_spec, client)
        sink = None
        if spec.job_type == JobType.PREDICT:
            from elasticdl.common.job_dirs import job_dir_for

            sink = PredictionSink(job_dir_for(spec), spec.prediction_output_format,
                                  model_spec.prediction_outputs_processor)
        # the version goes with every task result; between results, for progress,
        # at most every VERSION_REPORT_S (evaluations are the master's decision)
        client.version = lambda: runtime.model_version
        last_report = [time.monotonic()]

        def report_version(version: int) -> None:
            if time.monotonic() - last_report[0] >= VERSION_REPORT_S:
                last_report[0] = time.monotonic()
                client.report_version(version)

        try:
            stats = runtime.run(client, readers, sink, on_version=report_version)
            client.report_version(runtime.model_version)
            if client.export_model and spec.job_type == JobType.TRAIN:
                from elasticdl.common.job_dirs import job_dir_for

                if client.export_from:
                    # this worker did not train (allreduce: every member that did is
                    # gone): the master names the final model's checkpoint
                    from elasticdl.checkpoint import api as ckpt

                    runtime.load_state_dict(ckpt.load(staging.to_local(client.export_from),
                                                      "cpu"))
                    logger.info("exporting the final checkpoint %s (model version %d)",
                                client.export_from, runtime.model_version)
                elif spec.checkpoint_dir and spec.checkpoint_steps:  # the final model
                    logger.info("final checkpoint: %s",
                                runtime.save_final_checkpoint(client.export_closed))
                    # staged (object storage): complete in the bucket before the job can
                    # end, as a PS answers the final save only once its shard is up
                    staging.flush(spec.checkpoint_dir)
                faults.point("before_export", exporting=True)
                paths = runtime.export(job_dir_for(spec))
                faults.point("after_export", exporting=True)
                client.report_export(paths[0] if paths else job_dir_for(spec),
                                     runtime.model_version)
        finally:
            runtime.close()
        logger.info("worker %d done: %s", args.worker_id, stats)
        return 0
    except Exception as e:  # sent to the master as the root cause, then exit 1
        tb = traceback.format_exc()
        logger.error("worker %d failed: %s", args.worker_id, tb)
        if isinstance(e, ConnectionError):  # the master is gone: no one to tell
            return 1
        try:
            client.report_failure(f"worker-{args.worker_id}", f"{type(e).__name__}: {e}", tb)
        except ConnectionError:
            logger.error("could not report the failure: master unreachable")
        return 1
    finally:
        client.close()


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    configure_logging(args.job_spec.log_level, role=f"worker-{args.worker_id}")
    faults.set_role(f"worker-{args.worker_id}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        code = run_worker(args)
    finally:
        staging.stop_all(quiet=True)   # the checkpoints this worker wrote go up
    # Everything is reported, written and closed. End here rather than in
    # interpreter teardown, where destructors of process groups from earlier
    # elastic plans (whose peers are dead) can block for their full timeout.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
