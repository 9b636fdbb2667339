"""Who may do what: the RBAC objects a job runs under, and the job's Secret.

Plain dicts like :mod:`~elasticdl.cluster.manifests` (no client import). The
job token (and TLS certificate/key) live in one Secret owned by the master pod;
PS and worker pods read them by env (``secretKeyRef``), so the values never
appear in a pod spec. See docs/security.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Optional

from elasticdl.cluster.manifests import APP, LABEL_JOB, Manifest, to_yaml
from elasticdl.common import auth
from elasticdl.common.job_spec import JobSpec

# ----------------------------------------------------------------- RBAC
RBAC_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rbac.yaml")


def rbac_manifests(namespace: str = "default") -> list[Manifest]:
    """ServiceAccount, Role and RoleBinding of ``rbac.yaml`` for ``namespace``."""
    import yaml

    with open(RBAC_FILE, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for doc in docs:
        doc["metadata"]["namespace"] = namespace
        for subject in doc.get("subjects", []):
            subject["namespace"] = namespace
    return docs


def rbac_yaml(namespace: str = "default") -> str:
    """``rbac.yaml`` with ``namespace`` filled in, ready for ``kubectl apply -f -``."""
    return to_yaml(rbac_manifests(namespace))


# ----------------------------------------------------------------- job secret
SECRET_ENV_KEYS = ((auth.TOKEN_ENV, auth.TOKEN_KEY), (auth.TLS_CERT_ENV, auth.CERT_KEY),
                   (auth.TLS_KEY_ENV, auth.KEY_KEY))


def job_secret_name(job_name: str) -> str:
    return f"elasticdl-{job_name}-token"


def job_secret(job_spec: JobSpec, data: Mapping[str, str],
               owner: Optional[Manifest] = None) -> Manifest:
    """The job's Secret; ``data`` maps keys (``token``, ``tls.crt``, ``tls.key``) to
    base64 values."""
    metadata: Manifest = {"name": job_secret_name(job_spec.job_name),
                          "namespace": job_spec.namespace,
                          "labels": {"app": APP, LABEL_JOB: job_spec.job_name}}
    if owner:
        metadata["ownerReferences"] = [dict(owner)]
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": metadata,
            "data": dict(data)}


def secret_env(job_name: str, keys: Sequence[str], optional: bool = False) -> list[Manifest]:
    """Env entries reading the Secret's ``keys`` (of SECRET_ENV_KEYS). ``optional``:
    the pod starts without them while the Secret is absent (the master Job's pod: the
    first master makes the Secret, a restarted one reads the token from it)."""
    out: list[Manifest] = []
    for env, key in SECRET_ENV_KEYS:
        if key in keys:
            ref: Manifest = {"name": job_secret_name(job_name), "key": key}
            if optional:
                ref["optional"] = True
            out.append({"name": env, "valueFrom": {"secretKeyRef": ref}})
    return out


def master_job(job_spec: JobSpec, base: int) -> Manifest:
    """The master Job (:func:`~elasticdl.cluster.manifests.master_job`) whose pod reads
    the job's token/TLS from the Secret when a predecessor made it."""
    from elasticdl.cluster.k8s_master import master_job as job

    keys = [key for _, key in SECRET_ENV_KEYS]
    return job(job_spec, base, secret_env=secret_env(job_spec.job_name, keys, optional=True))


def with_secret_env(pod: Manifest, job_name: str, keys: Sequence[str]) -> Manifest:
    """``pod`` with the secret env added to its container (plain values of the same
    names, e.g. from ``--envs``, are dropped: the Secret wins)."""
    refs = secret_env(job_name, keys)
    names = {r["name"] for r in refs}
    container = pod["spec"]["containers"][0]
    container["env"] = [e for e in container.get("env", []) if e["name"] not in names] + refs
    return pod
