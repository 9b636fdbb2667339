"""Where a job's replicas run: the :class:`Cluster` interface.

The master creates replicas (PS and workers) through a Cluster and reacts to
the :class:`ReplicaEvent` stream it produces. ``ProcessCluster`` runs them as
local processes, ``KubernetesCluster`` as pods; both get the same
:class:`ReplicaSpec` so a local run exercises the Kubernetes code paths.
Backends are chosen by name from :mod:`elasticdl.cluster.registry`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional


class ReplicaType(str, enum.Enum):
    MASTER = "master"
    PS = "ps"
    WORKER = "worker"


class Phase(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DELETED = "deleted"


class ClusterError(RuntimeError):
    """The backend refused or failed an operation (message says why)."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What to run for one replica; the same for processes and pods.

    ``command`` is an argv list; ``env`` is added to the replica's environment.
    Resources are parsed Kubernetes quantities (``{"cpu": "1",
    "nvidia.com/gpu": "1"}``); a process backend records but cannot enforce them.
    """

    job_name: str
    type: ReplicaType
    index: int
    command: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    resource_requests: dict[str, str] = field(default_factory=dict)
    resource_limits: dict[str, str] = field(default_factory=dict)
    priority: str = ""
    port: int = 0  # the port the replica serves on (PS), 0 if none

    @property
    def name(self) -> str:
        """``worker-3``: unique within the job, stable for the job report."""
        return f"{self.type.value}-{self.index}"


@dataclass(frozen=True)
class ReplicaEvent:
    """A replica changed phase.

    ``reason`` is backend-neutral: ``"killed"`` (signal, preemption, exit
    137 without OOM), ``"oom"``, ``"error"`` (non-zero exit), ``"completed"``,
    ``"deleted"`` (removed by someone else), ``"preempted"`` (the scheduler
    deleted it for a higher-priority pod), ``"unschedulable"`` (pending: ``message``
    is the scheduler's reason).
    """

    type: ReplicaType
    index: int
    phase: Phase
    exit_code: Optional[int] = None
    reason: str = ""
    message: str = ""

    @property
    def name(self) -> str:
        return f"{self.type.value}-{self.index}"


class Cluster(ABC):
    """A place to run replicas. Implementations must be thread-safe."""

    @abstractmethod
    def endpoint(self, type: ReplicaType, index: int) -> tuple[int, str]:
        """``(port to bind, address others dial)`` for a serving replica.

        Local processes get a free loopback port; pods get a fixed port and
        their Service's DNS name.
        """

    @abstractmethod
    def create_replica(self, spec: ReplicaSpec) -> None:
        """Start a replica. Raises ClusterError if the backend refuses."""

    @abstractmethod
    def delete_replica(self, type: ReplicaType, index: int) -> None:
        """Stop a replica (no error if it is already gone)."""

    @abstractmethod
    def poll_events(self, timeout_s: float) -> list[ReplicaEvent]:
        """Events since the last call, waiting at most ``timeout_s`` for one."""

    @abstractmethod
    def close(self) -> None:
        """Stop every replica this cluster started and release resources."""

    def master_address(self) -> Optional[str]:
        """Address replicas dial to reach the master, if the backend fixes it."""
        return None

    def requested_workers(self) -> Optional[str]:
        """``"MIN:MAX"`` a user asked for from outside the master (Kubernetes: the
        master pod's ``elasticdl.org/num-workers`` annotation, set by ``elasticdl
        scale``), or None. Local jobs are resized through the master's RPC."""
        return None

    def adopt_replicas(self) -> list[ReplicaInfo]:
        """After a master restart: the replicas of this job that still run (local:
        from ``replicas.json`` pids; Kubernetes: pods by the job's labels), which
        this cluster now watches and reports events for as if it had created them.

        Backends that cannot adopt return an empty list (the master then starts
        replicas anew). Raises ClusterError if the backend cannot be read.
        """
        return []

    def finished_replicas(self) -> dict[tuple[ReplicaType, int], tuple[Phase, Optional[int]]]:
        """After a master restart: ``(type, index) -> (phase, exit code)`` of the job's
        replicas that ended while no master watched (Kubernetes: their pods, terminal and
        not being deleted). Backends that cannot tell return {}: every replica gone is
        then handled as killed."""
        return {}


@dataclass(frozen=True)
class ReplicaInfo:
    """A running replica found by :meth:`Cluster.adopt_replicas`."""

    type: ReplicaType
    index: int
    phase: Phase
    port: int = 0          # the port it serves on (PS), 0 if none
    address: str = ""      # the address others dial (PS), "" if none
    ident: str = ""        # backend identity: a pid or a pod uid

    @property
    def name(self) -> str:
        return f"{self.type.value}-{self.index}"
