"""The worker process: ``python -m elasticdl.worker.main --worker_id=N ...``.

Builds the trainer the strategy asks for, runs the shared task loop against
the master, and on the way out exports the final model when the master asks
this worker to. Its first exception is sent to the master (message and
traceback) before the process exits non-zero, so the job report names the
root cause.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional

from elasticdl.common.enums import JobType, Strategy
from elasticdl.common.job_spec import JobSpec, JobSpecError
from elasticdl.common.log_utils import configure_logging

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


def build_trainer(args: WorkerArgs, model_spec: Any, client: Any) -> Any:
    """The Trainer for this job's strategy and type."""
    from elasticdl.worker.trainer import LocalTrainer, select_device

    spec = args.job_spec
    device = select_device(spec.device)
    if spec.job_type != JobType.TRAIN:
        from elasticdl.checkpoint.api import load_for_inference

        trainer = LocalTrainer(model_spec, device, spec.seed)
        load_for_inference(trainer, spec.checkpoint_dir_for_init)
        return trainer
    if spec.distribution_strategy == Strategy.PS:
        from elasticdl.worker.ps_trainer import PSTrainer

        return PSTrainer(model_spec, list(args.ps_addrs), spec, args.worker_id, device)
    if spec.distribution_strategy == Strategy.ALLREDUCE:
        from elasticdl.worker.allreduce_trainer import AllreduceTrainer

        member = AllreduceTrainer(model_spec, spec, args.worker_id, device, client, args.host)
        if spec.checkpoint_dir_for_init:  # model, optimizer, version; not the data position
            from elasticdl.checkpoint.api import load

            member.load_state_dict(load(spec.checkpoint_dir_for_init, str(device)))
        return member
    raise ValueError(f"strategy {spec.distribution_strategy} does not run distributed workers")


def run_worker(args: WorkerArgs) -> int:
    from elasticdl.api.model_spec import load_from_job_spec
    from elasticdl.common.datasets import create_readers
    from elasticdl.worker.master_client import MasterClient
    from elasticdl.worker.prediction import PredictionSink
    from elasticdl.worker.task_loop import TaskLoop

    spec = args.job_spec
    client = MasterClient(args.master_addr, args.worker_id)
    try:
        model_spec = load_from_job_spec(spec)
        readers = create_readers(spec, model_spec.custom_data_reader)
        trainer = build_trainer(args, model_spec, client)
        sink = None
        if spec.job_type == JobType.PREDICT:
            from elasticdl.common.job_dirs import job_dir_for

            sink = PredictionSink(job_dir_for(spec), spec.prediction_output_format,
                                  model_spec.prediction_outputs_processor)
        # the version goes with every task result; between results, for progress,
        # at most every VERSION_REPORT_S (evaluations are the master's decision)
        client.version = lambda: trainer.model_version
        last_report = [time.monotonic()]

        def report_version(version: int) -> None:
            if time.monotonic() - last_report[0] >= VERSION_REPORT_S:
                last_report[0] = time.monotonic()
                client.report_version(version)

        if hasattr(trainer, "run"):  # AllreduceTrainer drives its own elastic loop
            stats = trainer.run(client, readers, prediction_sink=sink,
                                on_step=[lambda version, loss: report_version(version)])
        else:
            loop = TaskLoop(client, trainer, model_spec, readers, spec.minibatch_size,
                            worker_id=args.worker_id, prediction_sink=sink,
                            skip_nonfinite_steps=spec.skip_nonfinite_steps,
                            after_train_step=[lambda task, done, loss:
                                              report_version(trainer.model_version)])
            stats = loop.run()
        client.report_version(trainer.model_version)
        if client.export_model and spec.job_type == JobType.TRAIN:
            _export(trainer, spec)
        close = getattr(trainer, "close", None)
        if close is not None:
            close()
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


def _export(trainer: Any, spec: JobSpec) -> None:
    from elasticdl.checkpoint.api import export_model
    from elasticdl.common.job_dirs import job_dir_for

    export = getattr(trainer, "export_model", None)
    if export is not None:  # PS: pull the final parameters first
        export(job_dir_for(spec))
    else:
        export_model(trainer.model, job_dir_for(spec))


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    configure_logging(args.job_spec.log_level, role=f"worker-{args.worker_id}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    code = run_worker(args)
    # Everything is reported, written and closed. End here rather than in
    # interpreter teardown, where destructors of process groups from earlier
    # elastic plans (whose peers are dead) can block for their full timeout.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
