"""The evaluation barrier of the job core.

When an evaluation is due (the periodic rule of the Schedule, an epoch's end,
the end of training), training tasks stop going out (workers are told WAIT);
once no worker holds a training task any more the model no longer changes,
and the evaluation tasks are created labelled with the job's version at that
moment: the version they actually evaluate. Training resumes when the
evaluation is complete. Reasons that fall on one version share one
evaluation (``{"model_version", "metrics", "reasons", "epoch"}`` in the
report); the final one runs after the last training task and before the
model is exported, so ``final_metrics`` describe ``model.pt``. An epoch's
tasks go out only once the previous epoch is done, so an epoch-end evaluation
sees exactly the epochs up to its own.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from elasticdl.common.job_report import JobReport
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.lr_plateau import MetricSchedule
from elasticdl.master.task_manager import TaskManager
from elasticdl.master.task_state import EVAL_TYPES

logger = logging.getLogger("elasticdl.master.job")

Notify = Callable[..., None]


class EvaluationBarrier:
    """When evaluations are due, run, and done (``JobCore.evaluations``).

    It has no lock of its own: the core calls it under its lock (see
    :class:`elasticdl.master.core_base.CoreBase`), and the task manager's
    callbacks reach it from calls the core made. State (JSON-able):
    ``pending`` (``{"reasons", "epoch"}``: due, waiting for training tasks to
    come back), ``running`` (``{"version", "reasons", "epoch"}``: its tasks are
    out), ``last_evaluated`` and the epochs whose end was evaluated.

    Args:
        manage: False leaves evaluations to whoever queues them on the task
            manager (tests and tools around a bare task manager): requests are
            ignored.
        notify: the core's listeners (``on_evaluation``).
    """

    def __init__(self, tm: TaskManager, aggregator: EvaluationAggregator, report: JobReport,
                 notify: Notify, manage: bool = True) -> None:
        self.tm, self.aggregator, self.report = tm, aggregator, report
        self.notify = notify
        self.manage = manage
        # a metric-driven LR schedule (ReduceLROnPlateau), stepped at each evaluation
        self.metric_schedule: Optional[MetricSchedule] = None
        self.last_evaluated: Optional[int] = None
        self.pending: Optional[dict[str, Any]] = None
        self.running: Optional[dict[str, Any]] = None
        self.epochs_ended: set[int] = set()

    def idle(self) -> bool:
        """No evaluation due or running."""
        return self.pending is None and self.running is None

    def request(self, reason: str, epoch: Optional[int], version: int) -> None:
        """An evaluation is due for ``reason`` (at ``epoch``'s end, if any):
        training is held until the one due or running takes it."""
        if not self.tm.evaluation_records or not self.manage:
            return
        target = self.running or self.pending
        if target is None:
            target = self.pending = {"reasons": [], "epoch": None}
            self.tm.hold_training = True
        if reason not in target["reasons"]:
            target["reasons"].append(reason)
        if epoch is not None:
            target["epoch"] = epoch
        logger.info("evaluation due (%s) at model version %d", ", ".join(target["reasons"]),
                    version)

    def maybe_start(self, version: int) -> None:
        """Once no training task is out, the pending evaluation's tasks are
        created for ``version`` (the model as it is now)."""
        pending = self.pending
        if pending is None or self.tm.training_held():
            return
        self.pending = None
        if version == self.last_evaluated:  # this very model was evaluated already
            self.report.add_reasons(pending["reasons"], pending["epoch"])
            self.tm.hold_training = False
            return
        if not self.tm.create_evaluation_tasks(version):
            logger.warning("model version %d was evaluated before; %s not repeated", version,
                           pending["reasons"])
            self.tm.hold_training = False
            return
        self.running = {"version": version, **pending}

    def on_done(self, version: int) -> None:
        """The task manager's callback: every evaluation task of ``version`` is
        done (a finalize task follows for stateful metrics)."""
        running = self.running
        if running is None or running["version"] != version:
            return  # evaluation tasks queued on the task manager directly (tests, tools)
        if self.aggregator.needs_finalize(version):
            # stateful metrics: one more task merges the states on a worker
            self.tm.create_finalize_task(version)
            return
        metrics = self.aggregator.complete(version)
        self.report.add_evaluation(version, metrics, running["reasons"], running["epoch"])
        if self.metric_schedule is not None:
            self.metric_schedule.on_evaluation(version, metrics)
            self.report.extra["lr_schedule"] = self.metric_schedule.summary()
        self.notify("on_evaluation", version=version, metrics=dict(metrics))
        self.last_evaluated = version
        self.running = None
        self.tm.hold_training = self.pending is not None

    def on_epoch_end(self, epoch: int, version: int) -> None:
        """``epoch`` ended (a training job): its evaluation, once per epoch, and
        the final one once no training record is left — after whichever epoch ends
        last: a PS rollback that reopened an earlier epoch can make that one end
        after the last (its final evaluation had run, on the model rolled back)."""
        if epoch in self.epochs_ended:
            # a PS rollback reopened a finished epoch: its end was evaluated once
            logger.info("epoch %d ended again (PS rollback); its epoch-end evaluation "
                        "ran already", epoch)
        else:
            self.epochs_ended.add(epoch)
            self.request("epoch_end", epoch, version)
            self.notify("on_epoch_end", epoch=epoch, version=version)
        if self.tm.training_records_left() == 0:
            self.request("final", epoch, version)

    def after_rollback(self, version: int) -> None:
        """After a PS rollback: the running evaluation measured a model the PS no
        longer hold, so its tasks are dropped and it runs again; an epoch the
        rollback reopened is evaluated again when it ends again (its epoch-end and
        final reasons wait for that); everything else is evaluated on the model as
        it now is, under the version the job now has (``version``)."""
        tm = self.tm
        with tm._lock:
            reopened = {e for e in self.epochs_ended if tm._epoch_open_tasks.get(e, 0) > 0}
            self.epochs_ended -= reopened
            running = self.running
            if running is not None:
                dropped = running["version"]
                tm._blocks = [b for b in tm._blocks
                              if not (b.type in EVAL_TYPES and b.model_version == dropped)]
                tm._eval_requeued = type(tm._eval_requeued)(
                    t for t in tm._eval_requeued if t.model_version != dropped)
                for task_id in [k for k, d in tm._doing.items() if
                                d.task.model_version == dropped and d.task.type in EVAL_TYPES]:
                    del tm._doing[task_id]
                tm._eval_jobs.pop(dropped, None)
                self.aggregator.discard(dropped)
                self.running = None
                logger.warning("PS rollback: the evaluation of model version %d is dropped "
                               "and runs again (%s)", dropped, ", ".join(running["reasons"]))
                keep = [r for r in running["reasons"]
                        if not (running["epoch"] in reopened and r in ("epoch_end", "final"))]
                for reason in keep:
                    self.request(reason, None if running["epoch"] in reopened
                                 else running["epoch"], version)
            pending = self.pending
            if pending is not None and pending["epoch"] in reopened:
                pending["reasons"] = [r for r in pending["reasons"]
                                      if r not in ("epoch_end", "final")]
                if not pending["reasons"]:
                    self.pending = None
            tm.hold_training = self.pending is not None

    def state_dict(self) -> dict[str, Any]:
        """The barrier's part of the core's ``"evaluation"`` state."""
        return {"last_evaluated": self.last_evaluated, "pending": self.pending,
                "running": self.running, "epochs_ended": sorted(self.epochs_ended)}

    def load_state_dict(self, e: dict[str, Any]) -> None:
        self.last_evaluated = e["last_evaluated"]
        self.pending, self.running = e["pending"], e["running"]
        self.epochs_ended = set(e["epochs_ended"])
