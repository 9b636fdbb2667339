"""The master's manifests: its pod, the ``batch/v1`` Job that recreates it
(master failover, up to ``--max_master_restarts``), the Service that keeps its
address stable across restarts, and the ``--master_state_pvc`` volume holding its
journal. Replica pods and Services are in :mod:`elasticdl.cluster.manifests`.
"""

from __future__ import annotations

import json
from typing import Optional

from elasticdl.cluster.api import ReplicaType
from elasticdl.cluster.manifests import (
    DEFAULT_PORT_BASE,
    PORT_BASE_ENV,
    Manifest,
    labels,
    load_cluster_spec,
    master_job_name,
    master_service_name,
    pod_manifest,
    replica_port,
    resolve_priority,
)
from elasticdl.common import entry_points
from elasticdl.common import resources as res
from elasticdl.common.job_spec import JobSpec

MASTER_STATE_DIR = "/var/lib/elasticdl/job"  # the master's job dir on --master_state_pvc
MASTER_STATE_VOLUME = "master-state"
JOB_UID_ENV = "ELASTICDL_MASTER_JOB_UID"


def master_job_spec(job_spec: JobSpec) -> JobSpec:
    """The spec the master pod receives: k8s, no --yaml, --cluster_spec inlined."""
    patch = load_cluster_spec(job_spec.cluster_spec)
    return job_spec.replace(cluster="k8s", yaml="",
                            cluster_spec=json.dumps(patch, sort_keys=True) if patch else "")


def master_command(job_spec: JobSpec, port: int) -> list[str]:
    return [*entry_points.MASTER.argv(), f"--job_spec={master_job_spec(job_spec).to_json()}",
            f"--port={port}"]


def max_master_restarts(job_spec: JobSpec) -> int:
    """``--max_master_restarts`` (the Job's ``backoffLimit``)."""
    return job_spec.max_master_restarts


def master_state_pvc(job_spec: JobSpec) -> str:
    """``--master_state_pvc``: the claim holding the master's job directory ('' for none)."""
    return job_spec.master_state_pvc


def _with_master_state(pod: Manifest, job_spec: JobSpec) -> Manifest:
    """Mount ``--master_state_pvc`` at MASTER_STATE_DIR, sub path ``<job>-<Job uid>``
    (the Job controller's ``controller-uid`` label, through the downward API): every
    master pod of one Job shares it, a later job of the same name starts clean."""
    claim = master_state_pvc(job_spec)
    if not claim:
        return pod
    spec = pod["spec"]
    spec.setdefault("volumes", []).append(
        {"name": MASTER_STATE_VOLUME, "persistentVolumeClaim": {"claimName": claim}})
    container = spec["containers"][0]
    container["env"].append({"name": JOB_UID_ENV, "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['controller-uid']"}}})
    container.setdefault("volumeMounts", []).append(
        {"name": MASTER_STATE_VOLUME, "mountPath": MASTER_STATE_DIR,
         "subPathExpr": f"{job_spec.job_name}-$({JOB_UID_ENV})"})
    container["command"].append(f"--job_dir={MASTER_STATE_DIR}")
    return pod


def _restore_flag(job_spec: JobSpec) -> list[str]:
    """``--restore`` for every master pod of the Job (the first finds no journal and
    starts afresh; a recreated one continues the job and adopts the replicas)."""
    return ["--restore"]


def master_job(job_spec: JobSpec, base: int = DEFAULT_PORT_BASE,
               secret_env: Optional[list[Manifest]] = None) -> Manifest:
    """The ``batch/v1`` Job the client submits: it runs the master pod and recreates
    it (up to ``--max_master_restarts`` failures) when the pod fails or is deleted.

    ``secret_env`` (env entries reading the job's Secret, ``optional``) lets a
    restarted master keep the token its replicas hold. The Job is the job's root
    object: the replicas, Services and the Secret are owned by it.
    """
    pod = master_pod(job_spec, base)
    pod["spec"]["containers"][0]["command"] += _restore_flag(job_spec)
    _with_master_state(pod, job_spec)
    if secret_env:
        container = pod["spec"]["containers"][0]
        container["env"] = container["env"] + [dict(e) for e in secret_env]
    meta = pod["metadata"]
    template_meta = {k: meta[k] for k in ("labels", "annotations") if k in meta}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": master_job_name(job_spec.job_name),
                         "namespace": meta["namespace"], "labels": dict(meta["labels"])},
            "spec": {"backoffLimit": max_master_restarts(job_spec),
                     "template": {"metadata": template_meta, "spec": pod["spec"]}}}


def master_service(job_spec: JobSpec, port: int, owner: Optional[Manifest] = None) -> Manifest:
    """The ClusterIP Service in front of the master pod: a stable master address
    across master restarts."""
    metadata: Manifest = {"name": master_service_name(job_spec.job_name),
                          "namespace": job_spec.namespace,
                          "labels": labels(job_spec.job_name, ReplicaType.MASTER, 0)}
    if owner:
        metadata["ownerReferences"] = [dict(owner)]
    ports = [{"name": "grpc", "port": port, "targetPort": port, "protocol": "TCP"}]
    metrics = job_spec.master_metrics_port(port)
    if metrics >= 0:  # the Prometheus endpoint (docs/observability.md)
        ports.append({"name": "metrics", "port": metrics, "targetPort": metrics,
                      "protocol": "TCP"})
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata,
            "spec": {"type": "ClusterIP",
                     "selector": labels(job_spec.job_name, ReplicaType.MASTER, 0),
                     "ports": ports}}


def master_pod(job_spec: JobSpec, base: int = DEFAULT_PORT_BASE) -> Manifest:
    """The master pod the client creates; its command carries the job spec."""
    port = replica_port(base, ReplicaType.MASTER, 0)
    env = {PORT_BASE_ENV: str(base)} if base != DEFAULT_PORT_BASE else {}
    return pod_manifest(
        job_spec, type=ReplicaType.MASTER, index=0, command=master_command(job_spec, port),
        env=env, requests=res.parse_resources(job_spec.master_resource_request),
        limits=res.parse_resources(job_spec.master_resource_limit),
        priority_class=resolve_priority(job_spec.master_pod_priority, ReplicaType.MASTER),
        port=port)
