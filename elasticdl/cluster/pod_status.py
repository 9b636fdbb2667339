"""Pod status -> backend-neutral replica phase and reason (pure, no client).

The relaunch policy needs to tell apart why a replica ended:

========================================================  ===========  ==========
pod                                                       phase        reason
========================================================  ===========  ==========
Pending, PodScheduled=False/Unschedulable                 pending      unschedulable
Pending / Running                                         pending /    ""
                                                          running
Succeeded (exit 0)                                        succeeded    completed
Failed, container terminated reason OOMKilled             failed       oom
Failed, status.reason Evicted, or a DisruptionTarget      failed       killed
condition (preemption, eviction API, node pressure)
Failed, exit 137 (SIGKILL) or 143 (SIGTERM) without OOM   failed       killed
Failed, any other exit code                               failed       error
deleted (or deletionTimestamp set) before it finished,    deleted      killed
with a DisruptionTarget condition (preemption)
deleted before it finished, otherwise                     deleted      deleted
========================================================  ===========  ==========

The Kubernetes cluster refines ``killed``/``deleted`` of a deleted pod into
``preempted`` when a DisruptionTarget condition of reason ``Preemption*`` says so,
or, on servers before 1.26 (no such condition), the scheduler's ``Preempted``
Event does (:mod:`elasticdl.cluster.k8s_preemption`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from elasticdl.cluster.api import Phase, ReplicaType
from elasticdl.cluster.manifests import LABEL_INDEX, LABEL_TYPE

Pod = dict[str, Any]
KILL_EXIT_CODES = (137, 143)
TERMINAL = (Phase.SUCCEEDED, Phase.FAILED, Phase.DELETED)


@dataclass(frozen=True)
class PodState:
    """What a pod's status says about its replica."""

    phase: Phase
    reason: str = ""
    exit_code: Optional[int] = None
    message: str = ""

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL


def replica_of(pod: Pod) -> Optional[tuple[ReplicaType, int]]:
    """``(type, index)`` from the pod's labels; None if not an ElasticDL replica."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    try:
        return ReplicaType(labels[LABEL_TYPE]), int(labels[LABEL_INDEX])
    except (KeyError, ValueError):
        return None


def _terminated(pod: Pod) -> dict[str, Any]:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            return dict(term)
    return {}


def _disruption(pod: Pod) -> str:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            return str(cond.get("reason") or "DisruptionTarget")
    return ""


def _unschedulable(pod: Pod) -> str:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"):
            return str(cond.get("message") or "Unschedulable")
    return ""


def pod_state(pod: Pod, deleted: bool = False) -> PodState:
    """Translate a pod (a dict as the API returns it) per the module table."""
    status = pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    term = _terminated(pod)
    code = term.get("exitCode")
    code = int(code) if code is not None else None
    deleting = deleted or bool((pod.get("metadata") or {}).get("deletionTimestamp"))
    if phase == "Succeeded":
        return PodState(Phase.SUCCEEDED, "completed", code if code is not None else 0)
    if phase == "Failed" and (not deleting or term.get("reason") == "OOMKilled"):
        return _failed(pod, status, term, code)
    if deleting:  # graceful deletion kills the container: report why it was deleted
        disruption = _disruption(pod)
        if disruption:
            return PodState(Phase.DELETED, "killed", code, f"pod disrupted: {disruption}")
        return PodState(Phase.DELETED, "deleted", code, "pod deleted")
    if phase == "Running":
        return PodState(Phase.RUNNING)
    unschedulable = _unschedulable(pod)
    if unschedulable:
        return PodState(Phase.PENDING, "unschedulable", None, unschedulable)
    return PodState(Phase.PENDING)


def _failed(pod: Pod, status: dict[str, Any], term: dict[str, Any],
            code: Optional[int]) -> PodState:
    message = str(status.get("message") or term.get("message") or "")
    if term.get("reason") == "OOMKilled":
        return PodState(Phase.FAILED, "oom", code, message or "container OOMKilled")
    if status.get("reason") in ("Evicted", "Preempting", "Shutdown", "Terminated"):
        return PodState(Phase.FAILED, "killed", code, message or str(status["reason"]))
    disruption = _disruption(pod)
    if disruption:
        return PodState(Phase.FAILED, "killed", code, message or disruption)
    if code in KILL_EXIT_CODES:
        return PodState(Phase.FAILED, "killed", code, message or f"killed by a signal "
                        f"(exit {code})")
    if code == 0:  # Failed with exit 0: the pod failed around the container
        return PodState(Phase.FAILED, "error", code, message or "pod failed")
    return PodState(Phase.FAILED, "error", code, message)
