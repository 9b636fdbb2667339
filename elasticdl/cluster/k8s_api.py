"""Connecting to the Kubernetes API, and errors a person can act on.

Shared by :class:`~elasticdl.cluster.kubernetes.KubernetesCluster` (in the
master pod) and the client (``elasticdl status|logs|stop``). Imports the
official ``kubernetes`` client, so import this module only when Kubernetes is
used.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from elasticdl.cluster.api import ClusterError

logger = logging.getLogger(__name__)

#: (connect, read) seconds for ordinary API calls.
REQUEST_TIMEOUT = (5.0, 30.0)
#: What the client and the cluster catch from an API call: HTTP errors from the
#: server and transport errors (refused, reset, timed out).
API_ERRORS = (ApiException, urllib3.exceptions.HTTPError)


class KubeConfigError(ClusterError):
    """No usable Kubernetes configuration (no kubeconfig, not in a pod)."""


class PermissionDenied(ClusterError):
    """The API answered 403: the account lacks a verb (see ``elasticdl rbac``)."""


def load_api_client(kubeconfig: Optional[str] = None,
                    context: Optional[str] = None) -> client.ApiClient:
    """An ApiClient for the in-cluster account or a kubeconfig.

    In a pod (``KUBERNETES_SERVICE_HOST`` set, no explicit ``kubeconfig``) the
    service account is used; otherwise ``kubeconfig``, ``$KUBECONFIG`` or
    ``~/.kube/config``. Raises KubeConfigError saying where it looked.
    """
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException as e:
            raise KubeConfigError(f"in-cluster Kubernetes configuration is unusable: {e}") \
                from None
        return client.ApiClient(configuration)
    paths = [kubeconfig] if kubeconfig else _kubeconfig_paths()
    found = [p for p in paths if os.path.isfile(p)]
    if not found:
        raise KubeConfigError(
            "no Kubernetes configuration: looked for "
            f"{', '.join(paths) or '$KUBECONFIG'}; set KUBECONFIG or create ~/.kube/config "
            "(kubectl must work), or run inside a pod")
    try:
        return config.new_client_from_config(config_file=found[0], context=context,
                                             persist_config=False)
    except ConfigException as e:
        raise KubeConfigError(f"kubeconfig {found[0]} is unusable: {e}") from None


def _kubeconfig_paths() -> list[str]:
    env = os.environ.get("KUBECONFIG", "")
    if env:
        return [p for p in env.split(os.pathsep) if p]
    return [os.path.expanduser("~/.kube/config")]


def api_error(error: BaseException, action: str) -> ClusterError:
    """A ClusterError (PermissionDenied for 403) that says what failed and why."""
    if isinstance(error, ApiException):
        detail = _status_message(error)
        if error.status == 403:
            return PermissionDenied(
                f"permission denied to {action}: {detail}. The account needs the verbs of "
                "`elasticdl rbac` (apply it to the namespace, or ask an administrator)")
        if error.status == 401:
            return PermissionDenied(f"not authenticated to {action}: {detail}; check the "
                                    "credentials in your kubeconfig")
        return ClusterError(f"cannot {action}: HTTP {error.status} {detail}")
    return ClusterError(f"cannot {action}: Kubernetes API unreachable ({error})")


def _status_message(error: ApiException) -> str:
    """The ``message`` of a Kubernetes Status body, else the HTTP reason."""
    body = error.body
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if body:
        try:
            status = json.loads(body)
        except ValueError:
            return str(body)[:300]
        if isinstance(status, dict) and status.get("message"):
            return str(status["message"])
    return str(error.reason or "")


def is_status(error: BaseException, code: int) -> bool:
    """True if ``error`` is an API answer with HTTP status ``code``."""
    return isinstance(error, ApiException) and error.status == code


def list_pods(core: client.CoreV1Api, namespace: str,
              label_selector: str) -> tuple[list[dict[str, Any]], str]:
    """The pods as plain dicts (as the API sent them) and the list's resourceVersion.

    Raw JSON rather than client models: a pod status the model finds
    incomplete must not break a status report or the master's pod watch.
    """
    resp: Any = core.list_namespaced_pod(namespace, label_selector=label_selector,
                                    _preload_content=False, _request_timeout=REQUEST_TIMEOUT)
    try:
        data = json.loads(resp.data)
    finally:
        resp.release_conn()
    return list(data.get("items") or []), str((data.get("metadata") or {})
                                              .get("resourceVersion") or "")


def delete_object(delete: Any, name: str, namespace: str, **kwargs: Any) -> None:
    """Call a ``delete_namespaced_*`` method without deserializing its answer.

    Servers up to 1.22 answer a Service DELETE with a ``Status`` body (and a pod
    DELETE may answer one too), which kubernetes client 37 tries to read as the
    object and fails with a pydantic ValidationError, although the object is
    deleted. Nothing here needs the body; HTTP errors still raise ApiException.
    """
    resp = delete(name, namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT,
                  **kwargs)
    resp.release_conn()


def uid_of(obj: Any) -> str:
    """``metadata.uid`` of a client model (V1Pod...)."""
    meta = getattr(obj, "metadata", None)
    if meta is None or not meta.uid:
        raise ClusterError("the API returned an object without metadata.uid")
    return str(meta.uid)


def to_model(cls: Any, manifest: dict[str, Any]) -> Any:
    """The client model (V1Pod, V1Service) of a manifest dict."""
    model = cls.from_dict(manifest)
    if model is None:
        raise ClusterError(f"empty {cls.__name__} manifest")
    return model


def short_error(error: BaseException) -> str:
    """One line for a log: ``HTTP 503 Service Unavailable`` or the transport error."""
    status = getattr(error, "status", None)
    return f"HTTP {status} {getattr(error, 'reason', '')}" if status else str(error)


def create_service(core: client.CoreV1Api, namespace: str, manifest: dict[str, Any]) -> bool:
    """Create a Service; False if it already exists (409). Raises ClusterError."""
    name = manifest["metadata"]["name"]
    try:
        core.create_namespaced_service(namespace, to_model(client.V1Service, manifest),
                                       _request_timeout=REQUEST_TIMEOUT)
    except API_ERRORS as e:
        if is_status(e, 409):
            return False
        raise api_error(e, f"create service {name}") from None
    return True


def replace_secret(core: client.CoreV1Api, namespace: str, manifest: dict[str, Any]) -> None:
    """Create a Secret; one of the same name (an earlier job's, or a predecessor
    master's) is deleted first. Raises ClusterError."""
    name = manifest["metadata"]["name"]
    body = to_model(client.V1Secret, manifest)
    for attempt in (1, 2):
        try:
            core.create_namespaced_secret(namespace, body, _request_timeout=REQUEST_TIMEOUT)
            return
        except API_ERRORS as e:
            if not is_status(e, 409) or attempt == 2:
                raise api_error(e, f"create secret {name}") from None
        delete_secret(core, namespace, name)


def delete_secret(core: client.CoreV1Api, namespace: str, name: str) -> None:
    """Delete a Secret (no error if it is gone). Raises ClusterError."""
    try:
        core.delete_namespaced_secret(name, namespace, _request_timeout=REQUEST_TIMEOUT)
    except API_ERRORS as e:
        if not is_status(e, 404):
            raise api_error(e, f"delete secret {name}") from None
