"""Fakes that are real implementations of the ABCs (no mocks)."""

from __future__ import annotations

from elasticdl.cluster.api import Cluster, Phase, ReplicaEvent, ReplicaSpec, ReplicaType


class ScriptedCluster(Cluster):
    """Records created replicas; tests push events as a timeline."""

    def __init__(self):
        self.created: list[ReplicaSpec] = []
        self.deleted: list[tuple[ReplicaType, int]] = []
        self.pending: list[ReplicaEvent] = []
        self.closed = False

    def endpoint(self, type, index):
        return 7000 + index, f"ps-{index}.svc:{7000 + index}"

    def create_replica(self, spec: ReplicaSpec) -> None:
        self.created.append(spec)
        self.pending.append(ReplicaEvent(spec.type, spec.index, Phase.RUNNING))

    def delete_replica(self, type, index) -> None:
        self.deleted.append((type, index))

    def poll_events(self, timeout_s):
        out, self.pending = self.pending, []
        return out

    def close(self):
        self.closed = True

    def names(self):
        return [s.name for s in self.created]
