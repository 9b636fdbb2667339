"""The objects a job's master keeps beside its pods: the PS Services, the
master Service (a stable address across master restarts) and the Secret with
the job token. Created once (a predecessor master's are reused or replaced),
deleted when the job ends normally.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from elasticdl.cluster import k8s_access as access
from elasticdl.cluster import k8s_api, k8s_master
from elasticdl.cluster import manifests as mf
from elasticdl.cluster.api import ClusterError, ReplicaType
from elasticdl.cluster.k8s_api import API_ERRORS, api_error, delete_object, is_status
from elasticdl.common import auth
from elasticdl.common.job_spec import JobSpec

logger = logging.getLogger(__name__)


class JobObjects:
    """Args:
        core: a ``CoreV1Api``.
        owner: the owner reference every object gets (the master pod or its Job).
        job_secrets: the token (and TLS pair) the Secret holds; None: no Secret.
    """

    def __init__(self, core: Any, job_spec: JobSpec, owner: Optional[mf.Manifest],
                 job_secrets: Optional[auth.JobSecrets], port_base: int):
        self._core = core
        self.job_spec = job_spec
        self.namespace = job_spec.namespace
        self._owner = owner
        self._job_secrets = job_secrets
        self._port_base = port_base
        self._lock = threading.Lock()
        self.secret_keys: Optional[list[str]] = None  # set once the Secret exists
        self.services: set[str] = set()

    @property
    def has_secret(self) -> bool:
        return self._job_secrets is not None

    def ensure_master_service(self) -> None:
        port = mf.replica_port(self._port_base, ReplicaType.MASTER, 0)
        body = k8s_master.master_service(self.job_spec, port, self._owner)
        if k8s_api.create_service(self._core, self.namespace, body):  # else a predecessor's
            logger.info("created service %s -> master:%d", body["metadata"]["name"], port)

    def ensure_secret(self) -> list[str]:
        """Create the job's Secret (token, TLS) once, owned by the job's root; returns
        its keys. A Secret of the same name (an earlier job's; a predecessor master's,
        holding the same token) is replaced."""
        with self._lock:
            if self.secret_keys is not None:
                return self.secret_keys
            assert self._job_secrets is not None
            data = self._job_secrets.data()
            body = access.job_secret(self.job_spec, data, self._owner)
            k8s_api.replace_secret(self._core, self.namespace, body)
            logger.info("created secret %s (keys %s)", body["metadata"]["name"],
                        ", ".join(sorted(data)))
            self.secret_keys = sorted(data)
            return self.secret_keys

    def ensure_ps_service(self, index: int, port: int) -> None:
        body = mf.ps_service(self.job_spec, index, port, self._owner)
        name = body["metadata"]["name"]
        if k8s_api.create_service(self._core, self.namespace, body):  # else: it exists
            logger.info("created service %s -> ps-%d:%d", name, index, port)  # since before
        self.adopt_service(name)

    def adopt_service(self, name: str) -> None:
        with self._lock:
            self.services.add(name)

    def delete(self) -> list[str]:
        """Delete the PS Services and, without an owner, the Secret (with an owner it
        goes with it); returns what could not be deleted (logged, not raised)."""
        with self._lock:
            services = sorted(self.services)
            secret = self.secret_keys is not None
        failed = []
        for svc in services:
            try:
                delete_object(self._core.delete_namespaced_service, svc, self.namespace)
            except API_ERRORS as e:
                if not is_status(e, 404):
                    failed.append(svc)
                    logger.error("%s", api_error(e, f"delete service {svc}"))
        if self._owner is None and secret:
            try:
                k8s_api.delete_secret(self._core, self.namespace,
                                      access.job_secret_name(self.job_spec.job_name))
            except ClusterError as e:
                failed.append(str(e))
        return failed
