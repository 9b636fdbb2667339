"""The master's side of a metric-driven learning-rate schedule (``ReduceLROnPlateau``).

The job core calls :meth:`MetricSchedule.on_evaluation` with every completed
evaluation's metrics (under its lock, also when a restarted master replays its
journal, so the decision is the same after a failover); the schedule steps the
torch-free mirror (:class:`~elasticdl.common.plateau.PlateauState`) with the
monitored metric. :meth:`reductions` is the number of reductions decided so far:
every training task handed out carries it (``Task.lr_reductions``), and the PS
shards and allreduce members apply the ones they have not applied yet. It
cannot change while a training task is out: an evaluation runs only once no
worker holds one (the job core's evaluation barrier), so every step of one
task sees one count.

State: part of the job core's (journal snapshots) and written into each
checkpoint's metadata with the report (see :mod:`elasticdl.master.job_history`),
so a resumed job goes on with the same best value, patience and rate.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Optional

from elasticdl.common.plateau import PlateauRule, PlateauState

logger = logging.getLogger(__name__)


class MetricSchedule:
    def __init__(self, rule: PlateauRule):
        self.rule = rule
        self.state = PlateauState(rule)

    @classmethod
    def from_spec(cls, spec: Any) -> Optional[MetricSchedule]:
        text = getattr(spec, "lr_plateau", "")
        return cls(PlateauRule.from_json(text)) if text else None

    def reductions(self) -> int:
        return self.state.reductions

    def on_evaluation(self, version: int, metrics: Mapping[str, float]) -> bool:
        """Step with the evaluation of ``version``; whether the rate was reduced."""
        name = self.rule.monitor
        if name not in metrics:
            logger.error("evaluation of model version %d has no metric %r (it has %s): the "
                         "learning-rate schedule is not stepped", version, name,
                         sorted(metrics))
            return False
        value = float(metrics[name])
        reduced = self.state.step(value, version)
        if reduced:
            logger.info("learning-rate schedule: %s=%.6g did not improve on %.6g for more "
                        "than %d evaluation(s): reduction %d (rates %s), from model version "
                        "%d on", name, value, self.state.best, self.rule.patience,
                        self.state.reductions, self.state.lrs, version)
        return reduced

    def summary(self) -> dict[str, Any]:
        """The report's ``lr_schedule`` (bounded: no per-evaluation history)."""
        s = self.state
        return {"kind": "ReduceLROnPlateau", "monitor": self.rule.monitor,
                "mode": self.rule.mode, "evaluations": s.last_epoch,
                "reductions": s.reductions, "last_reduced_version": s.last_reduced_version,
                "best": s.best if math.isfinite(s.best) else None,
                "learning_rates": list(s.lrs)}

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        if state:
            self.state.load_state_dict(state)
