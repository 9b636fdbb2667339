"""``job_report.json``: the stable summary of a job (its fields are listed in the README).

The report is rewritten atomically as the job runs, so a reader never sees a
half-written file, and a crashed job still leaves its last state.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)

REPORT_NAME = "job_report.json"


@dataclass
class JobReport:
    job_name: str
    strategy: str
    cluster: str
    num_workers: int
    num_ps: int
    job_type: str = "train"
    status: str = "running"
    training_records: int = 0
    validation_records: int = 0
    prediction_records: int = 0
    epochs: list[dict[str, int]] = field(default_factory=list)
    relaunches: list[dict[str, Any]] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    final_metrics: dict[str, float] = field(default_factory=dict)
    failure: Optional[dict[str, Any]] = None
    # per epoch (as a string key, JSON-able): loss sum and records of the training
    # tasks that reported one, and a bounded summary of the learning rates their
    # steps were applied with ({first, last, min, max, count} in report order)
    training: dict[str, dict[str, Any]] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)
    # a resumed job: training records already in the model it resumed from (not
    # this run's work: training_records_per_s counts this run's records only)
    records_at_start: int = 0

    def add_evaluation(self, model_version: int, metrics: dict[str, float],
                       reasons: Sequence[str] = ("periodic",),
                       epoch: Optional[int] = None) -> None:
        """One evaluation of the model at ``model_version`` (the version it actually
        evaluated), run for ``reasons`` (``periodic``, ``epoch_end``, ``final``,
        ``evaluate``); the ``final`` one's metrics are ``final_metrics``."""
        if "final" in reasons:  # a PS rollback after the final one: this one is final
            for entry in self.evaluations:
                entry["reasons"] = [r for r in entry["reasons"] if r != "final"]
        self.evaluations.append({"model_version": model_version, "metrics": dict(metrics),
                                 "reasons": list(reasons), "epoch": epoch})
        if "final" in reasons or "evaluate" in reasons:
            self.final_metrics = dict(metrics)

    def add_reasons(self, reasons: Sequence[str], epoch: Optional[int] = None) -> None:
        """The last evaluation also serves ``reasons`` (its version is due again)."""
        entry = self.evaluations[-1]
        entry["reasons"] += [r for r in reasons if r not in entry["reasons"]]
        if epoch is not None:
            entry["epoch"] = epoch
        if "final" in reasons or "evaluate" in reasons:
            self.final_metrics = dict(entry["metrics"])

    def add_training(self, epoch: int, records: int, loss: Optional[float],
                     learning_rate: Optional[float]) -> None:
        """One finished training task of ``epoch``: its mean loss over ``records`` and
        the learning rate its last step was applied with (either may be unknown).
        O(1): the rates are kept as a summary, never as a list."""
        e = self.training.setdefault(str(epoch), {"loss_sum": 0.0, "records": 0,
                                                  "lr": None})
        if loss is not None and records > 0:
            e["loss_sum"] += float(loss) * records
            e["records"] += int(records)
        if learning_rate is not None:
            lr = float(learning_rate)
            s = e.get("lr")
            if s is None:
                e["lr"] = {"first": lr, "last": lr, "min": lr, "max": lr, "count": 1}
            else:
                s["last"] = lr
                s["min"], s["max"] = min(s["min"], lr), max(s["max"], lr)
                s["count"] += 1

    def training_summary(self) -> list[dict[str, Any]]:
        """Per epoch: mean training loss, the learning rates seen as ``learning_rates``
        (the distinct values of min and max: one value when the rate was constant
        over the epoch) and ``learning_rate`` (``{first, last, min, max, count}``
        over the epoch's task reports, or None) (report field ``training``)."""
        out = []
        for key in sorted(self.training, key=int):
            e = self.training[key]
            s = e.get("lr")
            out.append({"epoch": int(key),
                        "mean_loss": e["loss_sum"] / e["records"] if e["records"] else None,
                        "learning_rates": [] if s is None else sorted({s["min"], s["max"]}),
                        "learning_rate": None if s is None else dict(s)})
        return out

    def add_relaunch(self, replica: str, new_replica: str, reason: str,
                     exit_code: Optional[int]) -> None:
        self.relaunches.append({"replica": replica, "new_replica": new_replica,
                                "reason": reason, "exit_code": exit_code})

    def fail(self, replica: str, error: str, traceback: str = "") -> None:
        if self.failure is None:  # the first failure is the root cause
            self.failure = {"replica": replica, "error": error, "traceback": traceback}
        self.status = "failed"

    def to_dict(self) -> dict[str, Any]:
        wall = time.time() - self.started
        completed = sum(e.get("records_completed", 0) for e in self.epochs)
        this_run = completed - self.records_at_start
        timings = {"wall_s": round(wall, 3),
                   "training_records_per_s": round(this_run / wall, 3) if wall > 0 else 0.0}
        if self.records_at_start:  # resumed: this run's records and the earlier ones apart
            timings["training_records_this_run"] = this_run
            timings["training_records_resumed"] = self.records_at_start
        out = {
            "job_name": self.job_name, "job_type": self.job_type, "status": self.status,
            "strategy": self.strategy, "cluster": self.cluster,
            "num_workers": self.num_workers, "num_ps": self.num_ps,
            "dataset": {"training_records": self.training_records,
                        "validation_records": self.validation_records,
                        "prediction_records": self.prediction_records},
            "epochs": self.epochs, "relaunches": self.relaunches,
            "evaluations": self.evaluations, "final_metrics": self.final_metrics,
            "failure": self.failure, "training": self.training_summary(),
            "timings": timings,
        }
        out.update(self.extra)
        return out

    # the figures a restarted master carries on with (not its start time: the
    # timings of the new master's run)
    _STATE = ("status", "epochs", "relaunches", "evaluations", "final_metrics", "failure",
              "training", "extra", "records_at_start")

    def state_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps({k: getattr(self, k) for k in self._STATE}))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in self._STATE:
            if k in state:  # journals written before a field existed
                setattr(self, k, json.loads(json.dumps(state[k])))
        for e in self.training.values():   # a list of rates (older journals): summarised
            rates = e.pop("learning_rates", None)
            if rates:
                e["lr"] = {"first": rates[0], "last": rates[-1], "min": min(rates),
                           "max": max(rates), "count": len(rates)}
            e.setdefault("lr", None)

    def write(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, REPORT_NAME)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
        return path


def read_report(directory: str) -> dict[str, Any]:
    with open(os.path.join(directory, REPORT_NAME), encoding="utf-8") as f:
        return json.load(f)


def exported_model_version(path: str) -> Optional[int]:
    """For a job's output directory holding its exported ``model.pt`` (a plain
    state dict, not a ``version-N`` checkpoint): the model version its report
    names (0 without a report). None when ``path`` is not such a directory."""
    if not os.path.isfile(os.path.join(path, "model.pt")) or \
            os.path.exists(os.path.join(path, "DONE")):
        return None
    if any(n.startswith("version-") for n in os.listdir(path)):
        return None  # a checkpoint directory
    try:
        return int(read_report(path).get("model_version", 0))
    except (OSError, ValueError):
        return 0
