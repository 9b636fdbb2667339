"""What the job controller launches: each replica's command as typed values.

A replica's argv is rendered from a frozen spec (:class:`PSLaunch`,
:class:`WorkerLaunch`) by one function each, and its environment, resources
and priority from the job's :class:`ReplicaTemplate` of its type (from the
:class:`JobSpec`); :class:`ReplicaLauncher` turns them into the
cluster's :class:`ReplicaSpec` and creates it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from elasticdl.checkpoint import staging
from elasticdl.cluster.api import Cluster, ReplicaSpec, ReplicaType
from elasticdl.common import entry_points
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.resources import parse_envs, parse_resources, thread_env


@dataclass(frozen=True)
class PSLaunch:
    """One parameter server: ``elasticdl.ps.main``'s flags.

    Attributes:
        restore_from: the checkpoint source it restores (see
            :mod:`elasticdl.checkpoint.restore`).
        version_floor: the version the run started from (its versions never go
            below it).
        await_rollback: relaunched into an open PS rollback: it waits for the
            master's rollback before serving.
    """

    ps_id: int
    num_ps: int
    port: int
    restore_from: str
    version_floor: int
    await_rollback: bool = False

    def argv(self) -> tuple[str, ...]:
        return (*entry_points.PS.argv(), f"--ps_id={self.ps_id}",
                f"--num_ps={self.num_ps}", f"--port={self.port}",
                f"--restore_from={staging.to_url(self.restore_from)}",
                f"--version_floor={self.version_floor}",
                *(("--await_rollback",) if self.await_rollback else ()))


@dataclass(frozen=True)
class WorkerLaunch:
    """One worker: ``elasticdl.worker.main``'s flags (``ps_addrs``: none without PS)."""

    worker_id: int
    ps_addrs: tuple[str, ...] = ()

    def argv(self) -> tuple[str, ...]:
        return (*entry_points.WORKER.argv(), f"--worker_id={self.worker_id}",
                *((f"--ps_addrs={','.join(self.ps_addrs)}",) if self.ps_addrs else ()))


Launch = Union[PSLaunch, WorkerLaunch]


@dataclass(frozen=True)
class ReplicaTemplate:
    """What every replica of one type shares: environment, resources, priority."""

    env: dict[str, str] = field(default_factory=dict)
    resource_requests: dict[str, str] = field(default_factory=dict)
    resource_limits: dict[str, str] = field(default_factory=dict)
    priority: str = ""

    @classmethod
    def for_type(cls, spec: JobSpec, typ: ReplicaType) -> ReplicaTemplate:
        worker = typ == ReplicaType.WORKER
        requests = parse_resources(
            spec.worker_resource_request if worker else spec.ps_resource_request)
        limits = parse_resources(
            spec.worker_resource_limit if worker else spec.ps_resource_limit)
        return cls(env=thread_env(parse_envs(spec.envs), requests, limits),
                   resource_requests=requests, resource_limits=limits,
                   priority=spec.worker_pod_priority if worker else spec.ps_pod_priority)


class ReplicaLauncher:
    """Creates the job's replicas on ``cluster``; every one dials ``master_addr``
    and gets the job spec on its command line."""

    def __init__(self, spec: JobSpec, cluster: Cluster, master_addr: str) -> None:
        self.spec, self.cluster, self.master_addr = spec, cluster, master_addr

    def replica_spec(self, launch: Launch) -> ReplicaSpec:
        """The cluster's spec of ``launch`` (the flags every replica gets last)."""
        if isinstance(launch, PSLaunch):
            typ, index, port = ReplicaType.PS, launch.ps_id, launch.port
        else:
            typ, index, port = ReplicaType.WORKER, launch.worker_id, 0
        t = ReplicaTemplate.for_type(self.spec, typ)
        command = (*launch.argv(), f"--master_addr={self.master_addr}",
                   f"--job_spec={staging.for_children(self.spec).to_json()}")
        return ReplicaSpec(job_name=self.spec.job_name, type=typ, index=index,
                           command=command, env=dict(t.env),
                           resource_requests=dict(t.resource_requests),
                           resource_limits=dict(t.resource_limits), priority=t.priority,
                           port=port)

    def launch(self, launch: Launch) -> None:
        """Create the replica (raises ClusterError as the cluster does)."""
        self.cluster.create_replica(self.replica_spec(launch))
