"""Relaunch policy: what to do when a replica's phase changes.

Decisions are plain objects; the :class:`~elasticdl.master.job_controller.JobController`
applies them. Rules:

* a worker that exits 0 is done (ignore);
* a worker killed by a signal, preempted or deleted by someone else is always
  relaunched (with a new id);
* a worker that fails on its own (non-zero exit, OOM) is relaunched while its
  lineage has failed at most ``max_worker_relaunch`` times, else left dead;
* a PS that stops for any reason is relaunched (same index and address, from
  its latest checkpoint) up to ``max_ps_relaunch`` times, else the job fails;
* nothing is relaunched once the job is finishing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from elasticdl.cluster.api import Phase, ReplicaEvent, ReplicaType

ALWAYS_RELAUNCH = ("killed", "deleted", "preempted")


class Action(str, enum.Enum):
    IGNORE = "ignore"
    RELAUNCH = "relaunch"
    DROP = "drop"          # the replica is gone for good; the job goes on without it
    FAIL_JOB = "fail_job"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


@dataclass(frozen=True)
class RelaunchPolicy:
    max_worker_relaunch: int = 3
    max_ps_relaunch: int = 10

    def decide(self, event: ReplicaEvent, own_failures: int, finishing: bool) -> Decision:
        """``own_failures``: failures (not kills) of this replica's lineage so far,
        including this one."""
        if event.phase in (Phase.PENDING, Phase.RUNNING):
            return Decision(Action.IGNORE, "alive")
        if finishing:
            return Decision(Action.IGNORE, "job finishing")
        if event.phase == Phase.SUCCEEDED:
            if event.type == ReplicaType.WORKER:
                return Decision(Action.IGNORE, "worker done")
            return Decision(Action.RELAUNCH, f"{event.type.value} exited while the job runs")
        reason = event.reason or "error"
        if event.type == ReplicaType.PS:
            if own_failures > self.max_ps_relaunch:
                return Decision(Action.FAIL_JOB, f"PS failed {own_failures} times ({reason})")
            return Decision(Action.RELAUNCH, reason)
        if reason in ALWAYS_RELAUNCH:
            return Decision(Action.RELAUNCH, reason)
        if own_failures <= self.max_worker_relaunch:
            return Decision(Action.RELAUNCH, reason)
        return Decision(Action.DROP, f"{reason}; relaunched {self.max_worker_relaunch} "
                        "time(s) already")
