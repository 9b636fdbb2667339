"""Cluster backends by name; optional dependencies imported only when used.

``local`` -> :class:`~elasticdl.cluster.process.ProcessCluster` (no extra
dependency); ``k8s`` -> ``KubernetesCluster``, which imports the ``kubernetes``
client only when a Kubernetes job is run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elasticdl.cluster.api import Cluster


def _local(job_spec: Any, job_dir: str) -> Cluster:
    from elasticdl.cluster.process import ProcessCluster

    return ProcessCluster(job_dir)


def _k8s(job_spec: Any, job_dir: str) -> Cluster:
    from elasticdl.cluster.kubernetes import KubernetesCluster

    return KubernetesCluster.from_job_spec(job_spec, job_dir)


_BACKENDS: dict[str, Callable[[Any, str], Cluster]] = {"local": _local, "k8s": _k8s}


def create_cluster(name: str, job_spec: Any, job_dir: str) -> Cluster:
    """Build the backend ``name``. Raises ValueError for an unknown name."""
    try:
        factory = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown cluster backend {name!r}; known: "
                         f"{', '.join(sorted(_BACKENDS))}") from None
    return factory(job_spec, job_dir)
