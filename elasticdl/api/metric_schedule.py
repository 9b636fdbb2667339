"""Metric-driven learning-rate schedules (``ReduceLROnPlateau``): checked at load.

A module's ``lr_scheduler(optimizer)`` may return ``{"scheduler":
ReduceLROnPlateau(optimizer, ...), "monitor": "accuracy"}``: the scheduler is
stepped at every evaluation (periodic, epoch end, final) with that metric of
the evaluation. Where it runs:

* Local: the real scheduler, stepped in process with the metric;
* ParameterServerStrategy and AllreduceStrategy: the master (which never
  imports torch) steps a mirror of ReduceLROnPlateau's rule
  (:mod:`elasticdl.common.plateau`) and counts the reductions it decides; every
  training task carries that count, the workers forward it with their pushes,
  and each PS shard (before applying a push) and each allreduce member (at the
  same step on every member: the count is agreed with the step's gradients)
  applies the reductions it has not applied yet. The count is journaled with
  the evaluations (master failover) and checkpointed with the optimizers
  (resume).

:func:`metric_rule` is what the ``elasticdl`` command (and a Local job) run
before training: a missing ``--validation_data``, a monitor that is not one of
``eval_metrics_fn``'s metrics, or a metric-driven scheduler other than
ReduceLROnPlateau outside Local fail here, with the module named, not after an
epoch.
"""

from __future__ import annotations

from typing import Any, Optional

from elasticdl.api.model_spec import ModelSpec, ModelSpecError
from elasticdl.common.enums import JobType, Strategy
from elasticdl.common.plateau import PlateauRule


def metric_rule(model_spec: ModelSpec, job_spec: Any,
                model: Optional[Any] = None) -> Optional[PlateauRule]:
    """The module's metric-driven schedule as a rule for the master, or None when
    its scheduler (if any) is not metric-driven. Builds the model (unless given),
    its optimizer and scheduler once, as every replica will.

    Raises:
        ModelSpecError: the job cannot step the schedule (message names why).
    """
    if model_spec.lr_scheduler is None or job_spec.job_type != JobType.TRAIN:
        return None
    import torch

    if model is None:
        model = model_spec.build_model()
    optimizer = model_spec.make_optimizer(model.named_parameters())
    schedule = model_spec.make_lr_scheduler(optimizer)
    if schedule is None or schedule.interval != "evaluation":
        return None
    where = f"lr_scheduler in {model_spec.module_path}"
    kind = type(schedule.scheduler).__name__
    if not job_spec.validation_data:
        raise ModelSpecError(f"{where} returned {kind}, stepped at every evaluation with the "
                             f"metric {schedule.monitor!r}: the job has no evaluations; give "
                             "--validation_data")
    names = sorted(model_spec.metrics())
    if schedule.monitor not in names:
        raise ModelSpecError(f"{where}: monitor {schedule.monitor!r} is not a metric of "
                             f"eval_metrics_fn (it has {names})")
    if not isinstance(schedule.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        if job_spec.distribution_strategy != Strategy.LOCAL:
            raise ModelSpecError(
                f"{where} returned {kind}, whose step() takes a metric: under "
                f"{job_spec.distribution_strategy} the master decides the rate with "
                "ReduceLROnPlateau's rule (it holds no optimizer); use ReduceLROnPlateau "
                "or --distribution_strategy=Local")
        return None
    return PlateauRule.of_scheduler(schedule.scheduler, schedule.monitor,
                                    [float(g["lr"]) for g in optimizer.param_groups])


def with_metric_rule(job_spec: Any, rule: Optional[PlateauRule]) -> Any:
    """``job_spec`` carrying ``rule`` to the master (``lr_plateau``)."""
    return job_spec.replace(lr_plateau=rule.to_json() if rule is not None else "")


def check_replica(model_spec: ModelSpec, job_spec: Any, model: Any) -> None:
    """A distributed replica's check: when the module's schedule is metric-driven,
    the master must step it (the job spec carries its rule), else the rate would
    silently never move.

    Raises:
        ModelSpecError: the spec has no rule (the job was not started by a command
            that checked the model, e.g. the model zoo was not on that machine), or
            what :func:`metric_rule` raises.
    """
    if job_spec.lr_plateau or model_spec.lr_scheduler is None:
        return
    if metric_rule(model_spec, job_spec, model) is not None:
        raise ModelSpecError(
            f"lr_scheduler in {model_spec.module_path} is metric-driven (ReduceLROnPlateau) "
            "but the master was given no rule to step it: start the job with the elasticdl "
            "command on a machine that has the model zoo (it reads the rule from the module)")
