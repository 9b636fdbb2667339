"""Kubernetes manifests of a job, as plain dicts (no client import).

Pure functions from a :class:`~elasticdl.common.job_spec.JobSpec` (and a
:class:`~elasticdl.cluster.api.ReplicaSpec`) to the master pod, PS and worker
pods, PS Services and the RBAC objects. Both the client (``elasticdl train
--image_name=...``, ``--yaml``) and :class:`~elasticdl.cluster.kubernetes.
KubernetesCluster` build their objects here, and ``tests/k8s/test_manifests.py``
validates every shape against the upstream schemas.

Naming: pods are ``elasticdl-<job>-master``, ``elasticdl-<job>-ps-<i>`` and
``elasticdl-<job>-worker-<i>``; PS ``i`` gets the Service ``<job>-ps-<i>``
(``edl-<job>-ps-<i>`` when the job name starts with a digit, since Service
names must start with a letter). Every object carries the labels
``app=elasticdl``, ``elasticdl-job-name``, ``elasticdl-replica-type`` and
``elasticdl-replica-index``.

Ports: the master listens on ``port_base`` (50001), PS ``i`` on
``port_base + 1 + i`` and worker ``i`` on ``port_base + 1001 + i``. Distinct
ports cost nothing in pods (each has its own IP) and let the stand-in test
kubelet run a whole job on one host.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any, Optional

from elasticdl.cluster.api import ReplicaSpec, ReplicaType
from elasticdl.common import resources as res
from elasticdl.common.job_spec import JobSpec

APP = "elasticdl"
LABEL_JOB = "elasticdl-job-name"
LABEL_TYPE = "elasticdl-replica-type"
LABEL_INDEX = "elasticdl-replica-index"
CONTAINER = "elasticdl"
SERVICE_ACCOUNT = "elasticdl"
DEFAULT_PORT_BASE = 50001
PORT_BASE_ENV = "ELASTICDL_K8S_PORT_BASE"

Manifest = dict[str, Any]


# ----------------------------------------------------------------- names, ports
def pod_name(job_name: str, type: ReplicaType, index: int = 0) -> str:
    """``elasticdl-<job>-worker-3``; the master is ``elasticdl-<job>-master``."""
    if type == ReplicaType.MASTER:
        return f"elasticdl-{job_name}-master"
    return f"elasticdl-{job_name}-{type.value}-{index}"


def master_job_name(job_name: str) -> str:
    """The master Job's name, ``elasticdl-<job>-master``, at most 63 characters: the
    Job controller copies it into the ``job-name`` label of its pods (a label value;
    a real server rejects a longer one with 422). Longer names are cut and get a
    hash of the job name, so they stay unique."""
    name = pod_name(job_name, ReplicaType.MASTER)
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(job_name.encode()).hexdigest()[:8]
    return f"{name[:54].rstrip('-.')}-{digest}"


def ps_service_name(job_name: str, index: int) -> str:
    """The DNS-1035 name of PS ``index``'s Service."""
    name = f"{job_name}-ps-{index}"
    return name if name[0].isalpha() else f"edl-{name}"


def port_base(env: Optional[Mapping[str, str]] = None) -> int:
    """The master port; ``$ELASTICDL_K8S_PORT_BASE`` overrides 50001."""
    text = (os.environ if env is None else env).get(PORT_BASE_ENV, "")
    if not text:
        return DEFAULT_PORT_BASE
    if not text.isdigit() or not 1024 <= int(text) <= 60000:
        raise ValueError(f"${PORT_BASE_ENV}={text!r} must be a port in 1024..60000")
    return int(text)


def replica_port(base: int, type: ReplicaType, index: int) -> int:
    """The port a replica serves on (see the module docstring)."""
    if type == ReplicaType.MASTER:
        return base
    if type == ReplicaType.PS:
        return base + 1 + index
    return base + 1001 + index


def labels(job_name: str, type: ReplicaType, index: int = 0) -> dict[str, str]:
    return {"app": APP, LABEL_JOB: job_name, LABEL_TYPE: type.value, LABEL_INDEX: str(index)}


def job_selector(job_name: str) -> str:
    """Label selector of every object of a job."""
    return f"app={APP},{LABEL_JOB}={job_name}"


def owner_reference(name: str, uid: str, kind: str = "Pod") -> Manifest:
    """A reference to the job's root object: the master Job (``kind="Job"``), or the
    master pod of a job submitted as a bare pod. Deleting it garbage-collects the object.

    A reference to the Job is not a *controller* reference: the Job controller
    releases (strips the reference from) pods it controls that do not match its
    selector, which found on a real v1.20 control plane left replicas unowned.
    """
    job = kind == "Job"
    return {"apiVersion": "batch/v1" if job else "v1", "kind": kind, "name": name,
            "uid": uid, "controller": not job, "blockOwnerDeletion": True}


def master_service_name(job_name: str) -> str:
    """The DNS-1035 name of the Service in front of the master pod."""
    name = f"{job_name}-master"
    return name if name[0].isalpha() else f"edl-{name}"


# ----------------------------------------------------------------- cluster_spec
def load_cluster_spec(text: str) -> Manifest:
    """Parse ``--cluster_spec``: a JSON file path or inline JSON of a partial Pod.

    Allowed: ``{"metadata": {"labels": {...}, "annotations": {...}},
    "spec": {...any PodSpec field: affinity, tolerations, nodeSelector...}}``.
    Raises ValueError saying what is wrong.
    """
    text = text.strip()
    if not text:
        return {}
    if not text.startswith(("{", "[")):
        if not os.path.isfile(text):
            raise ValueError(f"--cluster_spec {text!r} is neither inline JSON nor a file")
        with open(text, encoding="utf-8") as f:
            text = f.read()
    try:
        patch = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--cluster_spec is not valid JSON: {e}") from None
    if not isinstance(patch, dict):
        raise ValueError("--cluster_spec must be a JSON object (a partial Pod)")
    unknown = set(patch) - {"metadata", "spec"}
    if unknown:
        raise ValueError(f"--cluster_spec: unknown top-level key(s) {sorted(unknown)}; "
                         'use {"metadata": {"annotations": ...}, "spec": {"tolerations": ...}}')
    meta = patch.get("metadata", {})
    if not isinstance(meta, dict) or set(meta) - {"labels", "annotations"}:
        raise ValueError("--cluster_spec: metadata may only hold labels and annotations")
    if not isinstance(patch.get("spec", {}), dict):
        raise ValueError("--cluster_spec: spec must be an object")
    return patch


def deep_merge(base: Any, patch: Any) -> Any:
    """Merge ``patch`` into a copy of ``base``.

    Dicts merge key by key; lists of named objects (containers, volumes, env)
    merge by ``name``; any other list or value in ``patch`` replaces.
    """
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = deep_merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and _named(base) and _named(patch):
        merged = [copy.deepcopy(b) for b in base]
        index = {item["name"]: i for i, item in enumerate(merged)}
        for item in patch:
            if item["name"] in index:
                merged[index[item["name"]]] = deep_merge(merged[index[item["name"]]], item)
            else:
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(patch)


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)


# ----------------------------------------------------------------- pods
def resolve_priority(priority: str, type: ReplicaType, high: bool = False) -> str:
    """The priorityClassName for a replica ('' for none).

    ``high``/``low`` and any other name are class names; a fraction (``"0.5"``)
    is only meaningful for workers, where the caller decides per worker
    (``high``) which of the two classes it gets.
    """
    priority = priority.strip()
    fraction = parse_fraction(priority)
    if fraction is None:
        return priority
    if type != ReplicaType.WORKER:
        raise ValueError(f"--{type.value}_pod_priority={priority!r}: a fraction only applies "
                         "to workers")
    return "high" if high else "low"


def parse_fraction(priority: str) -> Optional[float]:
    """``"0.5"`` -> 0.5; a class name -> None; a number outside [0, 1] -> ValueError."""
    try:
        value = float(priority)
    except ValueError:
        return None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"pod priority {priority!r}: a fraction must be in [0, 1]")
    return value


def _env_list(env: Mapping[str, str]) -> list[Manifest]:
    items: list[Manifest] = [
        {"name": "MY_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "MY_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    items += [{"name": k, "value": str(v)} for k, v in env.items()
              if k not in ("MY_POD_IP", "MY_POD_NAME")]
    return items


def _volumes(job_spec: JobSpec) -> tuple[list[Manifest], list[Manifest]]:
    volumes, mounts = [], []
    for i, vol in enumerate(res.parse_volumes(job_spec.volume)):
        name = f"volume-{i}"
        if "host_path" in vol:
            source: Manifest = {"hostPath": {"path": vol["host_path"]}}
            if vol.get("type"):
                source["hostPath"]["type"] = vol["type"]
        else:
            source = {"persistentVolumeClaim": {"claimName": vol["claim_name"]}}
        volumes.append({"name": name, **source})
        mount = {"name": name, "mountPath": vol["mount_path"]}
        if vol.get("sub_path"):
            mount["subPath"] = vol["sub_path"]
        mounts.append(mount)
    return volumes, mounts


def overcommittable(resource: str) -> bool:
    """cpu, memory, ephemeral-storage (any ``*kubernetes.io/`` name): a limit may exceed
    the request. Extended resources (``nvidia.com/gpu``) and hugepages may not."""
    if resource.startswith("hugepages-"):
        return False
    domain, slash, _ = resource.partition("/")
    return not slash or domain == "kubernetes.io" or domain.endswith(".kubernetes.io")


def extended_limits(requests: Mapping[str, str], limits: Mapping[str, str]) -> dict[str, str]:
    """``limits`` plus every requested extended resource, at its request.

    The API server rejects a pod that requests ``nvidia.com/gpu`` without a limit
    (422 "Limit must be set for non overcommitable resources") or with a different
    one, so ``--worker_resource_request=gpu=1`` alone sets the limit too. Raises
    ValueError when a given limit differs from the request.
    """
    out = dict(limits)
    for name, value in requests.items():
        if overcommittable(name):
            continue
        if name in out and out[name] != value:
            raise ValueError(f"{name}: request {value} and limit {out[name]} must be equal "
                             "(extended resources cannot be overcommitted)")
        out[name] = value
    return out


def pod_manifest(job_spec: JobSpec, *, type: ReplicaType, index: int,
                 command: list[str], env: Mapping[str, str],
                 requests: Mapping[str, str], limits: Mapping[str, str],
                 priority_class: str = "", port: int = 0,
                 owner: Optional[Manifest] = None) -> Manifest:
    """One replica's pod: labels, env (+downward API), resources, volumes, patch."""
    container: Manifest = {
        "name": CONTAINER,
        "image": job_spec.image_name,
        "imagePullPolicy": job_spec.image_pull_policy,
        "command": list(command),
        "env": _env_list({**res.parse_envs(job_spec.envs), **env}),
        "resources": {k: dict(v) for k, v in (("requests", requests),
                                              ("limits", extended_limits(requests, limits)))
                      if v},
    }
    if port:
        container["ports"] = [{"name": "grpc", "containerPort": port, "protocol": "TCP"}]
    if getattr(job_spec, "data_secret", ""):   # object-storage credentials, by reference
        container["envFrom"] = [{"secretRef": {"name": job_spec.data_secret}}]
    volumes, mounts = _volumes(job_spec)
    if mounts:
        container["volumeMounts"] = mounts
    spec: Manifest = {"restartPolicy": "Never", "containers": [container]}
    if volumes:
        spec["volumes"] = volumes
    if priority_class:
        spec["priorityClassName"] = priority_class
    if type == ReplicaType.MASTER:
        spec["serviceAccountName"] = SERVICE_ACCOUNT
    else:
        spec["automountServiceAccountToken"] = False
    metadata: Manifest = {"name": pod_name(job_spec.job_name, type, index),
                          "namespace": job_spec.namespace,
                          "labels": labels(job_spec.job_name, type, index)}
    if owner:
        metadata["ownerReferences"] = [dict(owner)]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}
    patch = load_cluster_spec(job_spec.cluster_spec)
    merged: Manifest = deep_merge(pod, patch) if patch else pod
    merged["metadata"]["labels"].update(labels(job_spec.job_name, type, index))
    return merged


def job_resources(job_spec: JobSpec, type: ReplicaType) -> tuple[dict[str, str],
                                                                  dict[str, str]]:
    """Parsed ``--<type>_resource_request`` and ``--<type>_resource_limit``."""
    return (res.parse_resources(getattr(job_spec, f"{type.value}_resource_request")),
            res.parse_resources(getattr(job_spec, f"{type.value}_resource_limit")))


def replica_pod(job_spec: JobSpec, spec: ReplicaSpec, priority_class: str = "",
                owner: Optional[Manifest] = None) -> Manifest:
    """A PS or worker pod from the master's ReplicaSpec.

    Empty resources in ``spec`` fall back to the job's flags for that type.
    """
    requests, limits = job_resources(job_spec, spec.type)
    return pod_manifest(
        job_spec, type=spec.type, index=spec.index, command=list(spec.command),
        env=spec.env, requests=spec.resource_requests or requests,
        limits=spec.resource_limits or limits, priority_class=priority_class,
        port=spec.port, owner=owner)


def ps_service(job_spec: JobSpec, index: int, port: int,
               owner: Optional[Manifest] = None) -> Manifest:
    """The ClusterIP Service in front of PS ``index``; it outlives PS relaunches."""
    metadata: Manifest = {"name": ps_service_name(job_spec.job_name, index),
                          "namespace": job_spec.namespace,
                          "labels": labels(job_spec.job_name, ReplicaType.PS, index)}
    if owner:
        metadata["ownerReferences"] = [dict(owner)]
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata,
            "spec": {"type": "ClusterIP",
                     "selector": labels(job_spec.job_name, ReplicaType.PS, index),
                     "ports": [{"name": "grpc", "port": port, "targetPort": port,
                                "protocol": "TCP"}]}}


def to_yaml(manifests: list[Manifest]) -> str:
    """Manifests as one multi-document YAML text."""
    import yaml

    return "---\n".join(yaml.safe_dump(m, sort_keys=False, width=100) for m in manifests)
