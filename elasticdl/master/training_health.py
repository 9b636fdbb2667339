"""Training health: is the loss the workers report going anywhere? (issue 28)

Workers report each training task's mean loss (``ReportTaskResultRequest.loss``;
a non-finite mean is not sent); a step whose loss or gradient is NaN/Inf fails its
task with ``NonFiniteError`` (or, with ``--skip_nonfinite_steps``, is skipped and
counted: the user's choice, not evidence here). :class:`LossHealth` folds
those reports into *windows* of ``window_tasks`` completed training tasks (the
records-weighted mean loss of the window) and decides, at each window's close:

* **non-finite** — a task failed with a non-finite loss or gradient: ``diverged``;
* **rising** — the window mean is above ``best × rise_factor`` *and* has climbed back
  more than ``rise_fraction`` of the way from the best window mean to the first
  window's mean (or above the first), for ``patience`` consecutive windows:
  ``diverged`` (the fraction keeps a healthy job's late noise — best 0.05, a window
  at 0.08 — from counting);
* **collapsed** — in ``patience`` consecutive windows, at least ``collapse_fraction``
  of the records were trained in steps whose outputs were identical for every record
  of the minibatch (the workers report them: :mod:`elasticdl.worker.collapse`):
  ``stalled``. The model no longer depends on its inputs (a CNN whose ReLUs died in
  its first async steps sits at ln 10, which after an early spike is *below* the
  first window's mean: the loss alone reads it as a plateau);
* **flat at its initial value** — after ``stall_windows`` windows, the best window
  mean is still within ``stall_progress`` of the initial value and the last
  ``stall_windows`` window means lie within ``stall_tolerance`` of each other:
  ``stalled`` (e.g. a CNN whose ReLUs died, stuck at ln 10 for ten classes). The
  initial value is the first task's loss where it is above the first window's mean:
  a model that learns most of what it can in its first window (a CTR model's log
  loss: DeepCTR's DeepFM went 0.63 in its first task, 0.605 as the first window's
  mean, 0.546 at best, AUC 0.735) had been called stalled against the window mean.

The relative rules need a positive first window mean (a "loss" that starts at 0 or
below, such as a counting fixture's, is judged only for non-finite values).

A non-finite verdict sticks. A rising or stalled one is an *episode*: when, for
``recover_windows`` consecutive windows, the condition that made it no longer holds
(the window mean back within ``best × rise_factor``; the best mean below
``initial × (1 - stall_progress)``), the status becomes ``recovered`` and judging goes
on (a later episode turns it unhealthy again). The report keeps the last episodes
with their evidence. Async PS jobs spike now and then and come back (a digits CNN,
2 async workers, one window of 256 records at more than half its initial loss); a
job that ends back at its best is not a diverged one, and under
``--on_divergence=warn`` it ends a plain ``succeeded`` with the episode in
``training_health`` (``fail`` and ``rollback`` act at the verdict, not waiting for a
recovery). After a rollback :meth:`LossHealth.restart` starts judging afresh and
keeps the history.

Pure: no I/O, no torch, no clock; bookkeeping is O(windows kept), never O(tasks).
:meth:`state_dict` is JSON-able (the job core snapshots and journals it).
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

__all__ = ["HealthRule", "HealthStatus", "LossHealth", "OnDivergence", "SUCCEEDED_WITH_WARNINGS",
           "final_status"]


class HealthStatus(str, enum.Enum):
    HEALTHY = "healthy"
    DIVERGED = "diverged"
    STALLED = "stalled"
    RECOVERED = "recovered"   # an episode (rising or stalled) that ended: healthy


class OnDivergence(str, enum.Enum):
    """``--on_divergence``: what the master does with an unhealthy verdict."""

    WARN = "warn"          # log it; the job ends ``succeeded_with_warnings``
    FAIL = "fail"          # the job fails with the verdict as its root cause
    # every PS back to the newest checkpoint at or before the best window, the learning
    # rate cut by --divergence_lr_factor, judged afresh (--max_divergence_rollbacks)
    ROLLBACK = "rollback"
    OFF = "off"            # no detector (no ``training_health`` in the report)


@dataclass(frozen=True)
class HealthRule:
    """The detector's thresholds (module docs)."""

    window_tasks: int = 8
    rise_factor: float = 1.25
    rise_fraction: float = 0.5
    patience: int = 2
    stall_windows: int = 6
    stall_tolerance: float = 0.02
    stall_progress: float = 0.1
    collapse_fraction: float = 0.9   # of a window's records in collapsed steps
    keep: int = 16            # window means kept as evidence (at least stall_windows)
    recover_windows: int = 3  # consecutive good windows that end a rising/stalled episode
    episodes_kept: int = 8    # the newest episodes kept as evidence (their count is kept)

    def __post_init__(self) -> None:
        if self.window_tasks < 1 or self.patience < 1 or self.stall_windows < 2 or \
                self.recover_windows < 1 or self.episodes_kept < 1 or \
                not 0 < self.collapse_fraction <= 1:
            raise ValueError(f"invalid health rule {self}")
        if self.keep < max(self.stall_windows, self.patience):
            raise ValueError(f"keep={self.keep} must hold stall_windows and patience windows")


class LossHealth:
    """Windowed loss judge (module docs)."""

    def __init__(self, rule: Optional[HealthRule] = None):
        self.rule = rule or HealthRule()
        self.status = HealthStatus.HEALTHY
        self.reason = ""
        self.windows = 0                    # windows closed since the last restart
        self.means: deque[float] = deque(maxlen=self.rule.keep)
        self.initial: Optional[float] = None
        self.first_task: Optional[float] = None   # the first task's mean loss
        self.best: Optional[float] = None
        self.rising = 0                     # consecutive rising windows
        self.restarts = 0
        self.verdict_window: Optional[int] = None
        self.cause = ""                     # the open episode's: rising, stalled, nonfinite
        self.recovering = 0                 # consecutive windows past the episode's cause
        self.episodes: deque[dict[str, Any]] = deque(maxlen=self.rule.episodes_kept)
        self.episode_count = 0
        self.best_version = 0               # model version when the best window closed
        self._version = 0                   # newest model version reported in the window
        self._sum = 0.0                     # the open window
        self._records = 0
        self._tasks = 0
        self._nonfinite = 0
        self._collapsed = 0                 # records of the open window's collapsed steps
        self._collapsed_at = -1             # the lowest version one of them trained on
        self.collapsing = 0                 # consecutive collapsed windows
        self.collapse_version: Optional[int] = None   # where that run of windows began
        self.alive_version = -1             # the highest version a step was not collapsed at

    # ----------------------------------------------------------------- input
    def observe(self, loss: Optional[float], records: int, nonfinite: bool = False,
                version: int = 0, collapsed: Collapse = (0, 0, -1)) -> bool:
        """A completed training task's mean loss over ``records`` (None: not reported),
        or a task that met a non-finite loss/gradient (``nonfinite``), at model
        ``version``; ``collapsed``: the records of its steps whose outputs were identical
        for every record, the lowest model version of those steps, and the highest
        version of a step whose outputs were not (-1: none). Returns True when this
        report turned the status unhealthy."""
        self._version = max(self._version, int(version))
        self.alive_version = max(self.alive_version, int(collapsed[2]))
        if collapsed[0] > 0 or collapsed[2] >= 0:
            logger.debug("training health: task of %d records at version %d: %d in collapsed "
                         "steps (from version %d), alive at %d", records, version,
                         collapsed[0], collapsed[1], collapsed[2])
        if collapsed[0] > 0:
            self._collapsed += int(collapsed[0])
            at = int(collapsed[1])
            self._collapsed_at = at if self._collapsed_at < 0 else min(self._collapsed_at, at)
        if nonfinite or (loss is not None and not math.isfinite(loss)):
            self._nonfinite += 1
        elif loss is not None and records > 0:
            if self.first_task is None:
                self.first_task = float(loss)
            self._sum += float(loss) * records
            self._records += int(records)
        self._tasks += 1
        if self._tasks < self.rule.window_tasks and not self._nonfinite:
            return False
        return self._close()

    def judge_task(self, success: bool, error: str, loss: Optional[float],
                   records: int, version: int = 0, collapsed: Collapse = (0, 0, -1)
                   ) -> None:
        """A training task's outcome: its mean loss, or a non-finite loss/gradient (the
        task failed with NonFiniteError); other failures are no evidence, nor are steps
        skipped under ``--skip_nonfinite_steps`` (the user's choice, in the report).
        A verdict that turns is logged with its evidence."""
        if success:
            turned = self.observe(loss, records, version=version, collapsed=collapsed)
        elif error.startswith("NonFiniteError"):
            turned = self.observe(None, 0, nonfinite=True, version=version)
        else:
            return
        if turned:
            self._log_verdict()

    def _log_verdict(self) -> None:
        logger.warning("training health: %s: %s (window means %s, best %s)",
                       self.status.value, self.reason, [round(m, 4) for m in self.means],
                       self.best)

    def finish(self) -> bool:
        """Training ended: the open window's tasks are judged as a window of their own,
        and a model whose last window collapsed is ``stalled`` even without ``patience``
        windows (there will be no more: the job would end with a model that ignores its
        inputs, e.g. one that died in its last tasks). Returns True when this turned the
        status unhealthy (the verdict logged); calling it again changes nothing."""
        turned = self._tasks > 0 and self._close()
        if not turned and self.healthy and self.collapsing > 0 and self.initial is not None \
                and self.initial > 0:
            turned = self._verdict(HealthStatus.STALLED,
                                   f"the model the training ended with collapsed: its outputs "
                                   f"were identical for every record of its minibatches in "
                                   f"its last {self.collapsing} window(s), from model version "
                                   f"{self.collapse_version} (it no longer depends on its "
                                   f"inputs, e.g. dead ReLUs)", "collapsed")
        if turned:
            self._log_verdict()
        return turned

    def restart(self) -> None:
        """Judge afresh (after a rollback): the verdict, the windows and the rise count
        go; the count of restarts, the model version reached (it never goes back) and
        the references stay: the first window's mean and the best one (with its
        version) describe the same model on the same data, and a restart that took its
        first window (the restored, already trained model) as the initial value would
        call the noise of a converged loss a divergence."""
        keep = (self.restarts + 1, self._version, self.initial, self.first_task, self.best,
                self.best_version, self.episodes, self.episode_count, self.alive_version)
        self.__init__(self.rule)  # type: ignore[misc]
        (self.restarts, self._version, self.initial, self.first_task, self.best,
         self.best_version, self.episodes, self.episode_count, self.alive_version) = keep

    # -------------------------------------------------------------- deciding
    def _close(self) -> bool:
        nonfinite, records, total = self._nonfinite, self._records, self._sum
        collapsed_records, collapsed_at = self._collapsed, self._collapsed_at
        self._sum, self._records, self._tasks, self._nonfinite = 0.0, 0, 0, 0
        self._collapsed, self._collapsed_at = 0, -1
        if nonfinite:
            if self.cause in ("rising", "stalled"):   # an open episode turns non-finite
                self.status, self.cause = HealthStatus.DIVERGED, "nonfinite"   # and sticks
                self.reason += f"; then a non-finite loss or gradient in {nonfinite} task(s)"
                self.episodes[-1].update(status=self.status.value, cause="nonfinite",
                                         reason=self.reason)
                return False
            return self._verdict(HealthStatus.DIVERGED,
                                 f"non-finite loss or gradient in {nonfinite} task(s)",
                                 "nonfinite")
        if records == 0:
            return False   # no loss reported in this window (e.g. a custom loop)
        mean = total / records
        self.windows += 1
        self.means.append(mean)
        if self.initial is None:
            self.initial = mean
        if self.best is None or mean < self.best:
            self.best = mean
            self.best_version = self._version
        if self.initial <= 0 or self.cause == "nonfinite":
            return False   # judged for non-finite values only; a non-finite verdict sticks
        r, best, initial = self.rule, self.best, self.initial
        collapsed = collapsed_records >= r.collapse_fraction * records
        if not self.healthy:
            self._maybe_recover(mean, collapsed)
            return False
        if collapsed:
            self.collapsing += 1
            self.collapse_version = collapsed_at if self.collapse_version is None else \
                min(self.collapse_version, collapsed_at)
        else:
            self.collapsing, self.collapse_version = 0, None
        if self.collapsing >= r.patience:   # (finish(): one window, at the end)
            return self._verdict(HealthStatus.STALLED,
                                 f"the model's outputs were identical for every record of "
                                 f"its minibatches ({r.collapse_fraction:.0%} of the records "
                                 f"or more) in {self.collapsing} windows from model version "
                                 f"{self.collapse_version}: it no longer depends on its "
                                 f"inputs (collapsed, e.g. dead ReLUs; window mean "
                                 f"{mean:.4g})", "collapsed")
        if mean > best * r.rise_factor and mean > best + r.rise_fraction * (initial - best):
            self.rising += 1
        else:
            self.rising = 0
        if self.rising >= r.patience:
            return self._verdict(HealthStatus.DIVERGED,
                                 f"window mean {mean:.4g} rose above the best {best:.4g} for "
                                 f"{self.rising} windows", "rising")
        if self.windows >= r.stall_windows and best >= self._start() * (1 - r.stall_progress):
            last = list(self.means)[-r.stall_windows:]
            if max(last) - min(last) <= r.stall_tolerance * abs(sum(last) / len(last)):
                return self._verdict(HealthStatus.STALLED,
                                     f"the loss never left its initial value "
                                     f"{self._start():.4g} "
                                     f"in {self.windows} windows (last {last[-1]:.4g})",
                                     "stalled")
        return False

    def _start(self) -> float:
        """The initial value a stall is judged against: the first window's mean, or the
        first task's loss where that is higher (module docs)."""
        assert self.initial is not None
        return max(self.initial, self.first_task if self.first_task is not None
                   else self.initial)

    def _maybe_recover(self, mean: float, collapsed: bool) -> None:
        """An open rising/stalled episode: has its cause gone for recover_windows?"""
        r = self.rule
        assert self.best is not None and self.initial is not None
        if self.cause == "rising":
            past = mean <= self.best * r.rise_factor
        elif self.cause == "collapsed":
            past = not collapsed
        else:
            past = self.best < self._start() * (1 - r.stall_progress)
        self.recovering = self.recovering + 1 if past else 0
        if self.recovering < r.recover_windows:
            return
        self.episodes[-1]["recovered_window"] = self.windows
        logger.warning("training health: recovered from %s (%s) after %d windows; window "
                       "means %s, best %.4g", self.status.value, self.reason,
                       self.windows - (self.verdict_window or 0),
                       [round(m, 4) for m in self.means], self.best)
        self.status, self.cause, self.rising, self.recovering = \
            HealthStatus.RECOVERED, "", 0, 0
        self.collapsing, self.collapse_version = 0, None

    def _verdict(self, status: HealthStatus, reason: str, cause: str) -> bool:
        if not self.healthy:
            return False
        self.status, self.reason, self.verdict_window = status, reason, self.windows
        self.cause, self.recovering = cause, 0
        self.episode_count += 1
        self.episodes.append({"status": status.value, "cause": cause, "reason": reason,
                              "window": self.windows, "version": self._version,
                              "recovered_window": None})
        if cause == "collapsed":
            self.episodes[-1]["since_version"] = self.collapse_version
        return True

    @property
    def rollback_version(self) -> int:
        """The newest model version a divergence rollback may restore. A collapsed
        model: before the collapse began (the first collapsed step's version) and no
        newer than a version a step was seen alive at (async workers train on versions
        a few behind: the model may have died between the last step seen alive and the
        first seen collapsed). Else the best window's."""
        if self.cause == "collapsed" and self.collapse_version is not None:
            before = self.collapse_version - 1
            return max(0, min(before, self.alive_version) if self.alive_version >= 0
                       else before)
        return self.best_version

    @property
    def healthy(self) -> bool:
        """No open episode: never unhealthy, or recovered from every episode."""
        return self.status in (HealthStatus.HEALTHY, HealthStatus.RECOVERED)

    # ---------------------------------------------------------------- report
    def report(self) -> dict[str, Any]:
        """The job report's ``training_health``: status and its evidence."""
        return {"status": self.status.value, "reason": self.reason,
                "windows": self.windows, "verdict_window": self.verdict_window,
                "window_means": [round(m, 6) for m in self.means],
                "initial": self.initial, "first_task": self.first_task, "best": self.best,
                "best_version": self.best_version, "restarts": self.restarts,
                "episodes": list(self.episodes),
                "episode_count": self.episode_count, "thresholds": asdict(self.rule)}

    def state_dict(self) -> dict[str, Any]:
        return {"status": self.status.value, "reason": self.reason, "windows": self.windows,
                "means": list(self.means), "initial": self.initial,
                "first_task": self.first_task, "best": self.best, "rising": self.rising,
                "restarts": self.restarts,
                "verdict_window": self.verdict_window, "best_version": self.best_version,
                "version": self._version, "cause": self.cause, "recovering": self.recovering,
                "episodes": list(self.episodes), "episode_count": self.episode_count,
                "collapsing": self.collapsing, "collapse_version": self.collapse_version,
                "alive_version": self.alive_version,
                "open": [self._sum, self._records, self._tasks, self._nonfinite,
                         self._collapsed, self._collapsed_at]}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        if not state:
            return
        self.status = HealthStatus(state["status"])
        self.reason = state["reason"]
        self.windows = int(state["windows"])
        self.means = deque((float(m) for m in state["means"]), maxlen=self.rule.keep)
        self.initial, self.best = state["initial"], state["best"]
        self.first_task = state.get("first_task")   # (older states: none)
        self.rising, self.restarts = int(state["rising"]), int(state["restarts"])
        self.verdict_window = state.get("verdict_window")
        self.best_version = int(state.get("best_version", 0))
        self._version = int(state.get("version", 0))
        self.cause = state.get("cause") or ("" if self.status in (
            HealthStatus.HEALTHY, HealthStatus.RECOVERED) else "nonfinite")  # older: sticky
        self.recovering = int(state.get("recovering", 0))
        self.episodes = deque(state.get("episodes", []), maxlen=self.rule.episodes_kept)
        self.episode_count = int(state.get("episode_count", len(self.episodes)))
        s, rec, tasks, nf, *collapsed = state["open"]   # (older states: 4 fields)
        self._sum, self._records, self._tasks, self._nonfinite = float(s), int(rec), int(tasks), \
            int(nf)
        self._collapsed, self._collapsed_at = (int(collapsed[0]), int(collapsed[1])) \
            if collapsed else (0, -1)
        self.collapsing = int(state.get("collapsing", 0))
        cv = state.get("collapse_version")
        self.collapse_version = None if cv is None else int(cv)
        self.alive_version = int(state.get("alive_version", -1))


SUCCEEDED_WITH_WARNINGS = "succeeded_with_warnings"

Collapse = tuple[int, int, int]
"""A task's collapsed records, the lowest version of its collapsed steps, the highest
of its steps that were not (-1: none): :mod:`elasticdl.worker.collapse`."""


def final_status(status: str, verdict: Optional[tuple[HealthStatus, str]],
                 divergence_rollbacks: int = 0) -> str:
    """The job report's terminal ``status``: a job that would succeed with an
    unhealthy verdict (``--on_divergence=warn``), or healthy only after a divergence
    rollback, ends ``succeeded_with_warnings``, never a plain ``succeeded``."""
    warned = verdict is not None or divergence_rollbacks > 0
    return SUCCEEDED_WITH_WARNINGS if status == "succeeded" and warned else status
