"""Pod status -> replica phase/reason: the table in elasticdl/cluster/pod_status.py."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from elasticdl.cluster.api import Phase, ReplicaType
from elasticdl.cluster.pod_status import pod_state, replica_of


def pod(phase: str, exit_code: Optional[int] = None, reason: str = "",
        status_reason: str = "", conditions: Optional[list[dict[str, str]]] = None,
        deleting: bool = False) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "conditions": conditions or []}
    if exit_code is not None:
        status["containerStatuses"] = [{"name": "c", "state": {"terminated": {
            "exitCode": exit_code, "reason": reason}}}]
    if status_reason:
        status["reason"] = status_reason
    meta: dict[str, Any] = {"name": "p", "labels": {"elasticdl-replica-type": "worker",
                                                      "elasticdl-replica-index": "3"}}
    if deleting:
        meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    return {"metadata": meta, "status": status}


DISRUPTED = [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]
UNSCHEDULABLE = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                  "message": "0/3 nodes have enough nvidia.com/gpu"}]


@pytest.mark.parametrize("obj, deleted, expected", [
    (pod("Pending"), False, (Phase.PENDING, "", None)),
    (pod("Pending", conditions=UNSCHEDULABLE), False, (Phase.PENDING, "unschedulable", None)),
    (pod("Running"), False, (Phase.RUNNING, "", None)),
    (pod("Succeeded", 0, "Completed"), False, (Phase.SUCCEEDED, "completed", 0)),
    (pod("Failed", 137, "OOMKilled"), False, (Phase.FAILED, "oom", 137)),
    (pod("Failed", 137, "Error"), False, (Phase.FAILED, "killed", 137)),
    (pod("Failed", 143, "Error"), False, (Phase.FAILED, "killed", 143)),
    (pod("Failed", 137, "Error", status_reason="Evicted"), False, (Phase.FAILED, "killed", 137)),
    (pod("Failed", 1, "Error", conditions=DISRUPTED), False, (Phase.FAILED, "killed", 1)),
    (pod("Failed", 2, "Error"), False, (Phase.FAILED, "error", 2)),
    (pod("Failed", 128, "StartError"), False, (Phase.FAILED, "error", 128)),
    (pod("Running"), True, (Phase.DELETED, "deleted", None)),
    (pod("Running", conditions=DISRUPTED), True, (Phase.DELETED, "killed", None)),
    (pod("Running", deleting=True), False, (Phase.DELETED, "deleted", None)),
    (pod("Failed", 143, "Error", deleting=True), False, (Phase.DELETED, "deleted", 143)),
    (pod("Failed", 137, "OOMKilled", deleting=True), True, (Phase.FAILED, "oom", 137)),
    (pod("Succeeded", 0, "Completed"), True, (Phase.SUCCEEDED, "completed", 0)),
])
def test_pod_state(obj, deleted, expected):
    state = pod_state(obj, deleted)
    assert (state.phase, state.reason, state.exit_code) == expected


def test_unschedulable_message_and_replica_labels():
    assert "nvidia.com/gpu" in pod_state(pod("Pending", conditions=UNSCHEDULABLE)).message
    assert replica_of(pod("Running")) == (ReplicaType.WORKER, 3)
    assert replica_of({"metadata": {"labels": {"app": "x"}}}) is None
