"""The phase of a job on a cluster, and the one rule that moves it.

The :class:`~elasticdl.master.job_controller.JobController` observes the job
once per pass of its loop (:class:`Observation`) and asks :func:`next_phase`
where the job is now; the answer (:class:`PhaseStep`) carries the failure to
record, if the step fails the job. The rule is pure: tests drive it with
observations, no cluster.

::

    RUNNING --every task done--> FINISHING --exported, workers gone--> SUCCEEDED
       ^                            |  (a PS rollback reopens training: RUNNING)
       +----------------------------+
    any --stop--> STOPPED;  any --a failure--> FAILED
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

Failure = tuple[str, str, str]
"""``(replica, error, traceback)``: a job failure's root cause."""

# workers still running once the final model is written get this long to exit
SETTLE_S = 10.0


class JobPhase(str, enum.Enum):
    """Where a job is. Its value is the job report's ``status`` once terminal."""

    RUNNING = "running"
    FINISHING = "finishing"   # every task done: waiting for the export and the workers
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def is_terminal(self) -> bool:
        """The job is over (the controller's loop ends)."""
        return self in (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED)

    @property
    def winding_down(self) -> bool:
        """Training is over for now: finishing, or over for good."""
        return self == JobPhase.FINISHING or self.is_terminal


@dataclass(frozen=True)
class Observation:
    """What one pass of the controller saw.

    Attributes:
        now: monotonic seconds.
        stop_requested: the master was asked to stop.
        failed: the job report holds a failure already.
        task_failure: a task failed for good (the task manager's root cause).
        finished: the core says every task is done (see ``JobCore.finished``).
        exported: the final model is written (or the job exports none).
        live_workers: workers alive now.
        first_failure: the first worker failure, if any.
    """

    now: float
    stop_requested: bool = False
    failed: bool = False
    task_failure: Optional[Failure] = None
    finished: bool = False
    exported: bool = False
    live_workers: int = 0
    first_failure: Optional[Failure] = None


@dataclass(frozen=True)
class PhaseStep:
    """The phase after a pass; ``since``: when FINISHING began; ``failure``: the
    root cause to record (FAILED by this step)."""

    phase: JobPhase
    since: Optional[float] = None
    failure: Optional[Failure] = None


def next_phase(phase: JobPhase, since: Optional[float], seen: Observation,
               finish_timeout_s: float) -> PhaseStep:
    """The phase after ``phase`` (FINISHING since ``since``) given ``seen``."""
    if phase.is_terminal:
        return PhaseStep(phase, since)
    if seen.stop_requested:
        return PhaseStep(JobPhase.STOPPED)
    if seen.failed:
        return PhaseStep(JobPhase.FAILED)
    if seen.task_failure is not None:
        return PhaseStep(JobPhase.FAILED, failure=seen.task_failure)
    if seen.finished:
        began = since if phase == JobPhase.FINISHING and since is not None else seen.now
        if seen.exported and (seen.live_workers == 0 or seen.now - began > SETTLE_S):
            return PhaseStep(JobPhase.SUCCEEDED, began)
        if seen.now - began > finish_timeout_s:
            return PhaseStep(JobPhase.FAILED, began, (
                "master", "workers did not finish (final model export) within "
                f"{finish_timeout_s:.0f} s", ""))
        return PhaseStep(JobPhase.FINISHING, began)
    # not finished (any more: a PS rollback reopened training)
    if seen.live_workers == 0:
        replica, msg, tb = seen.first_failure or ("master", "every worker is gone", "")
        return PhaseStep(JobPhase.FAILED, failure=(
            replica, f"every worker has failed; first failure: {msg}", tb))
    return PhaseStep(JobPhase.RUNNING)
