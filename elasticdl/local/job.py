"""``--distribution_strategy=Local``: a whole job in one process.

The master's :class:`JobCore` (tasks, ledger, schedule, evaluations, report)
runs in process behind a :class:`LocalTaskSource`, with the same flags and
rules as the gRPC master; the worker's :class:`TaskLoop` is the same code the
distributed workers run.

A model module with ``train_loop(ctx)`` runs as a one-member elastic allreduce
group (:class:`~elasticdl.elastic.solo.SoloComm`): the loop gets the same
``ctx`` as under AllreduceStrategy, so it can be debugged in one process.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from elasticdl.api.metric_schedule import metric_rule, with_metric_rule
from elasticdl.api.model_spec import ModelSpec, load_from_job_spec
from elasticdl.checkpoint import api as ckpt
from elasticdl.checkpoint import data_position
from elasticdl.common.enums import JobType
from elasticdl.common.job_dirs import job_dir_for
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.progress import Progress
from elasticdl.common.task import Task
from elasticdl.data.datasets import create_readers
from elasticdl.local.task_source import LocalTaskSource
from elasticdl.master import job_history, observability
from elasticdl.master.job import JobCore
from elasticdl.master.job_factory import core_from_spec
from elasticdl.master.training_health import OnDivergence, final_status
from elasticdl.worker.prediction import PredictionSink
from elasticdl.worker.task_loop import LoopStats, TaskLoop
from elasticdl.worker.trainer import LocalTrainer, select_device

if TYPE_CHECKING:  # imported when a module defines train_loop: a plain Local job never needs it
    from elasticdl.worker.allreduce_trainer import AllreduceTrainer

logger = logging.getLogger(__name__)


class LocalJob:
    """Builds the collaborators of a Local job and runs it."""

    def __init__(self, spec: JobSpec, model_spec: Optional[ModelSpec] = None):
        self.model_spec = model_spec or load_from_job_spec(spec)
        # a metric-driven LR schedule fails here, before any training, when the job
        # cannot step it; the core's mirror of its rule reports the reductions
        spec = with_metric_rule(spec, metric_rule(self.model_spec, spec))
        self.spec = spec
        self.readers = create_readers(spec, self.model_spec.custom_data_reader,
                                      model_spec=self.model_spec)
        self.custom_loop = (spec.job_type == JobType.TRAIN
                            and self.model_spec.train_loop is not None)
        # a custom loop's checkpoints name trained records by task id: ids of a run
        # never collide with an earlier run's (as the master's)
        first = int(time.time() * 1000) << 16 if self.custom_loop else 0
        self.core = core_from_spec(spec, self.readers, first_task_id=first)
        self.task_manager = self.core.tm
        self.report = self.core.report
        self.out_dir = job_dir_for(spec)
        self.source = LocalTaskSource(self.core, version=lambda: self.trainer.model_version)
        device = select_device(spec.device)
        self.trainer: Union[LocalTrainer, AllreduceTrainer]
        if self.custom_loop:  # train_loop(ctx): a one-member elastic group
            from elasticdl.elastic.solo import SoloComm
            from elasticdl.worker.allreduce_trainer import AllreduceTrainer

            self.trainer = AllreduceTrainer(self.model_spec, spec, 0, device, SoloComm(),
                                            "127.0.0.1")
        elif spec.job_type != JobType.TRAIN:   # the model of --checkpoint_dir_for_init
            from elasticdl.worker.inference import inference_trainer

            self.trainer = inference_trainer(self.model_spec, spec, device)
        else:
            self.trainer = LocalTrainer(self.model_spec, device, spec.seed, amp=spec.amp,
                                        clip_grad_norm=spec.clip_grad_norm)
        self._records_done_in_task: dict[int, int] = {}
        self.progress: Optional[Progress] = None
        self._last_saved = 0
        self._stepper = _MetricStepper(self.trainer.extras, self.core)
        self.core.add_listener(self._stepper)

    # -------------------------------------------------------------- hooks
    def _after_train_step(self, task: Task, done: int, loss: torch.Tensor) -> None:
        prev = self._records_done_in_task.get(task.task_id, 0)
        self._records_done_in_task[task.task_id] = done
        version = self.trainer.model_version
        if self.progress is not None:
            fields: dict[str, Any] = {"epoch": task.epoch, "version": version}
            if version % 10 == 0 or done == task.num_records:
                fields["loss"] = float(loss)
            self.progress.update(done - prev, **fields)
        self.source.report_version(version)  # the core decides about evaluations
        if self.core.schedule.checkpoint_due(version, self._last_saved):
            self.save_checkpoint(partial={task.task_id: done})

    def _run_custom_loop(self) -> LoopStats:
        from elasticdl.worker.allreduce_trainer import AllreduceTrainer

        assert isinstance(self.trainer, AllreduceTrainer)
        logger.info("model module defines train_loop(ctx): running it as a one-member "
                    "elastic group")
        return self.trainer.run(self.source, self.readers,
                                on_step=[lambda version, loss: self.source.report_version(
                                    version)])

    def _after_task(self, task: Task) -> None:
        self._records_done_in_task.pop(task.task_id, None)
        if self._stepper.error is not None:
            raise self._stepper.error

    def save_checkpoint(self, partial: Optional[dict[int, int]] = None) -> str:
        self.core.refresh_report()   # the job history at this version (job_history)
        state = self.trainer.state_dict()
        state["data_position"] = self.task_manager.state_dict(partial)
        self._last_saved = self.trainer.model_version
        return ckpt.save(self.spec.checkpoint_dir, self.trainer.model_version, state,
                         self.spec.keep_checkpoint_max)

    def _restore(self) -> None:
        if self.spec.job_type != JobType.TRAIN:   # loaded by inference_trainer
            self.core.start_at_version(self.trainer.model_version)
            return
        state = ckpt.load(self.spec.checkpoint_dir_for_init,
                          map_location=str(self.trainer.device))
        if self.custom_loop:
            state = dict(state)  # the data position says what is left to train
            state.pop("trained_records", None)
            state.pop("data_position", None)
        self.trainer.load_state_dict(state)
        if "data_position" in state:
            self.task_manager.load_state_dict(state["data_position"])
        self.core.start_at_version(self.trainer.model_version)
        self._last_saved = self.trainer.model_version

    # ---------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        spec, tm = self.spec, self.task_manager
        if self.custom_loop:
            # the loop's checkpoints hold trained records by task id (as allreduce
            # rank 0 writes them); the task table of the run resolves them into a data
            # position any strategy resumes from (refused, naming why, when it cannot)
            data_position.attach(tm, spec.checkpoint_dir, spec.checkpoint_dir_for_init)
        if spec.checkpoint_dir_for_init:
            self._restore()
        # a resumed job's report covers the whole job; --checkpoint_dir records it
        job_history.attach(self.core, spec)
        self.core.begin()
        sink = None
        if spec.job_type == JobType.PREDICT:
            sink = PredictionSink(self.out_dir, spec.prediction_output_format,
                                  self.model_spec.prediction_outputs_processor)
        loop = TaskLoop(self.source, self.trainer, self.model_spec,
                        self.readers, spec.minibatch_size, prediction_sink=sink,
                        after_train_step=[self._after_train_step], after_task=[self._after_task],
                        skip_nonfinite_steps=spec.skip_nonfinite_steps,
                        eval_minibatch_size=spec.eval_minibatch_size)
        if spec.job_type == JobType.TRAIN and not self.custom_loop:
            self.progress = Progress(tm.training_records_left(), "training")
        logger.info("job %s: %s on %s, output in %s", spec.job_name, spec.job_type,
                    self.trainer.device, self.out_dir)
        start = time.monotonic()
        # TensorBoard scalars in <--output>/tensorboard, as the master writes them
        obs = observability.attach(self.core, spec.output)
        try:
            stats = self._run_custom_loop() if self.custom_loop else loop.run()
        except BaseException as e:
            self.core.refresh_report()
            self.report.fail("worker-0", f"{type(e).__name__}: {e}", traceback.format_exc())
            self.report.write(self.out_dir)
            raise
        finally:
            obs.close()
            if self.progress is not None:
                self.progress.close()
        self.report.extra["nonfinite_steps_skipped"] = stats.nonfinite_skipped
        if tm.failure is not None:  # a task failed --max_task_retries times
            self.core.refresh_report()
            self.report.fail("worker-0", tm.failure.describe(), tm.failure.traceback)
            self.report.write(self.out_dir)
            raise TaskFailedError(tm.failure.describe())
        wall = time.monotonic() - start
        if spec.job_type == JobType.TRAIN:
            if spec.checkpoint_dir and spec.checkpoint_steps:
                self.save_checkpoint()
            ckpt.export_model(self.trainer.model, self.out_dir, spec.export_torchscript)
        self.core.finish_health()
        self.core.refresh_report()
        verdict = self.core.health_verdict()
        if verdict is not None and spec.on_divergence == OnDivergence.FAIL.value:
            self.report.fail("master", f"training {verdict[0].value}: {verdict[1]} "
                             "(--on_divergence=fail)", "")
            self.report.write(self.out_dir)
            return self.report.to_dict()
        self.report.status = final_status("succeeded", verdict)
        self.report.extra["nonfinite_steps_skipped"] = stats.nonfinite_skipped
        self.report.extra["model_version"] = self.trainer.model_version
        self.report.extra["loop_wall_s"] = round(wall, 3)
        path = self.report.write(self.out_dir)
        logger.info("job %s succeeded in %.1f s; report: %s", spec.job_name, wall, path)
        return self.report.to_dict()


class _MetricStepper:
    """Local: steps the real scheduler with the monitored metric of each evaluation
    (in the training thread: the core completes evaluations in its calls)."""

    def __init__(self, extras: Any, core: JobCore):
        self.extras = extras
        self.core = core
        self.error: Optional[BaseException] = None   # raised in the training loop

    def on_evaluation(self, version: int, metrics: dict[str, float]) -> None:
        schedule = self.extras.schedule
        if schedule is None or schedule.interval != "evaluation":
            return
        if schedule.monitor not in metrics:
            logger.error("evaluation of model version %d has no metric %r: the learning-rate "
                         "schedule is not stepped", version, schedule.monitor)
            return
        try:
            self.extras.step_metric(metrics[schedule.monitor])
        except Exception as e:  # noqa: BLE001 - re-raised by the training loop
            self.error = e
            raise
        mirror = self.core.metric_schedule
        lrs = [float(g["lr"]) for g in schedule.scheduler.optimizer.param_groups]
        if mirror is not None and mirror.state.lrs and mirror.state.lrs != lrs:
            logger.warning("the master's ReduceLROnPlateau mirror has rates %s, the "
                           "scheduler %s", mirror.state.lrs, lrs)
        logger.info("%s stepped with %s=%.6g at model version %d: learning rate %s",
                    type(schedule.scheduler).__name__, schedule.monitor,
                    metrics[schedule.monitor], version,
                    [g["lr"] for g in schedule.scheduler.optimizer.param_groups])

    def __getattr__(self, name: str) -> Any:   # the other JobListener events: nothing
        if name.startswith("on_"):
            return lambda **fields: None
        raise AttributeError(name)


class TaskFailedError(RuntimeError):
    """A task failed ``--max_task_retries`` times; the job failed."""


def run_local_job(spec: JobSpec) -> dict[str, Any]:
    """Run a Local-strategy train, evaluate or predict job; returns the job report."""
    return LocalJob(spec).run()


__all__ = ["LocalJob", "run_local_job"]
