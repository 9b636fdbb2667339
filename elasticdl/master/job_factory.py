"""Building a job's core from its spec: the one place a job's task manager,
schedule and report are made (every mode: the gRPC master, Local)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Optional

from elasticdl.common.enums import JobType, Strategy
from elasticdl.common.job_report import JobReport, exported_model_version
from elasticdl.common.schedule import Schedule
from elasticdl.common.task import TaskType
from elasticdl.master.job import JobCore
from elasticdl.master.lr_plateau import MetricSchedule
from elasticdl.master.task_manager import TaskManager
from elasticdl.master.training_health import HealthRule, LossHealth


def core_from_spec(spec: Any, readers: Mapping[TaskType, Any], first_task_id: int = 0,
                   start_version: int = 0) -> JobCore:
    """The job core of ``spec`` reading ``readers`` (task ids from ``first_task_id``,
    the model from ``start_version``)."""
    from elasticdl.data.datasets import shards_for

    # wall-clock time: held tasks' start times stay meaningful across a master restart;
    # only a PS job that writes checkpoints can roll back (re-open closed tasks)
    rollbacks = spec.distribution_strategy == Strategy.PS and \
        bool(spec.checkpoint_dir)
    tm = TaskManager(records_per_task=spec.records_per_task, num_epochs=spec.num_epochs,
                     shuffle=spec.shuffle, seed=spec.seed,
                     max_task_retries=spec.max_task_retries,
                     task_timeout_s=spec.task_timeout_s, first_task_id=first_task_id,
                     clock=time.time, settle_on_close=not rollbacks,
                     **shards_for(dict(readers), spec))
    report = report_for(spec, tm)
    core = JobCore(tm, report, Schedule.from_spec(spec), minibatch_size=spec.minibatch_size,
                   job_type=spec.job_type, start_version=start_version)
    core.metric_schedule = MetricSchedule.from_spec(spec)
    core.task_readers = dict(readers)   # the byte spans of tasks (master/servicer.py)
    if getattr(spec, "on_divergence", "off") != "off" and spec.job_type == JobType.TRAIN:
        core.health = LossHealth(HealthRule(window_tasks=spec.health_window_tasks))
        core.divergence_lr_factor = float(getattr(spec, "divergence_lr_factor", 0.5))
        core.divergence_sync = bool(spec.use_async and getattr(spec, "divergence_sync", True))
        core.divergence_sync_workers = max(1, int(getattr(spec, "num_workers", 1) or 1))
    return core


def start_version_of(path: str) -> int:
    """The model version of a checkpoint, or of a job's output with its exported
    ``model.pt`` (the version its report names), to start from."""
    from elasticdl.checkpoint import paths

    exported = exported_model_version(path)
    if exported is not None:
        return exported
    return paths.version_of(paths.resolve(path))


def report_for(spec: Any, tm: Optional[TaskManager] = None, **fields: Any) -> JobReport:
    """The job report of ``spec`` (every mode builds it here); ``tm`` gives the
    dataset sizes, ``fields`` e.g. a failure at start-up."""
    from elasticdl.common.strategy import entry_for

    local = spec.distribution_strategy == Strategy.LOCAL
    sizes: dict[str, Any] = {} if tm is None else {"training_records": tm.training_records,
                                   "validation_records": tm.evaluation_records,
                                   "prediction_records": tm.prediction_records}
    return JobReport(spec.job_name, spec.distribution_strategy,
                     "local" if local else spec.cluster, 1 if local else spec.num_workers,
                     entry_for(spec.distribution_strategy).num_ps(spec), job_type=spec.job_type,
                     **sizes, **fields)
