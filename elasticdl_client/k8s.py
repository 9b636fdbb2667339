"""Client side of Kubernetes jobs: submit, status, logs, stop, rbac.

Every function prints to ``out`` (stdout) / stderr and returns the process
exit code; the CLI calls ``sys.exit(fn(...))``:

* 0 — done (submitted, manifests written, status/logs shown, stopped);
* 1 — the API refused or failed (job already exists, no such job/replica,
  API unreachable);
* 2 — usage or environment: no kubeconfig, no permission (401/403), a bad
  ``--cluster_spec``.

``status`` shows each replica's pod phase and exit reason, then the job's
progress as the last lines of the master pod's log (the master logs progress
and the job report figures as it runs; nothing else has to be kept in sync).

A job is a ``batch/v1`` Job running the master pod (recreated by the Job
controller after a failure or deletion, up to ``--max_master_restarts``); the
master's pods are found by the job's labels, the newest being the current one.
``stop`` deletes the Job (or, for a job submitted before, its bare master pod);
the garbage collector removes the rest.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import IO, Any, Optional

from elasticdl.cluster import k8s_access as access
from elasticdl.cluster import manifests as mf
from elasticdl.cluster.api import ClusterError, ReplicaType
from elasticdl.common.job_spec import JobSpec

logger = logging.getLogger(__name__)

OK, API_FAILED, USAGE = 0, 1, 2


def _error(command: str, message: str, code: int) -> int:
    print(f"elasticdl {command}: error: {message}", file=sys.stderr)
    return code


def _cluster_error_code(error: ClusterError) -> int:
    from elasticdl.cluster.k8s_api import KubeConfigError, PermissionDenied

    return USAGE if isinstance(error, (KubeConfigError, PermissionDenied)) else API_FAILED


@contextlib.contextmanager
def _core(kubeconfig: Optional[str]) -> Iterator[Any]:
    """A CoreV1Api for the kubeconfig; raises KubeConfigError without one."""
    from kubernetes import client

    from elasticdl.cluster.k8s_api import load_api_client

    api = load_api_client(kubeconfig)
    try:
        yield client.CoreV1Api(api)
    finally:
        api.close()


def write_yaml(job_spec: JobSpec, out: IO[str] = sys.stdout) -> int:
    """Write the master Job manifest to ``job_spec.yaml`` instead of submitting."""
    try:
        text = mf.to_yaml([access.master_job(job_spec, mf.port_base())])
    except ValueError as e:
        return _error(job_spec.job_type, str(e), USAGE)
    try:
        with open(job_spec.yaml, "w", encoding="utf-8") as f:
            f.write(f"# elasticdl {job_spec.job_type} job {job_spec.job_name}: apply with "
                    f"kubectl apply -n {job_spec.namespace} -f {job_spec.yaml}\n"
                    "# (needs the RBAC of `elasticdl rbac` in the namespace first)\n")
            f.write(text)
    except OSError as e:
        return _error(job_spec.job_type, f"cannot write --yaml={job_spec.yaml}: {e}", USAGE)
    print(f"wrote the manifest of job {job_spec.job_name} to {job_spec.yaml}", file=out)
    return OK


def submit(job_spec: JobSpec, kubeconfig: Optional[str] = None,
           out: IO[str] = sys.stdout) -> int:
    """Create the master Job (its pod's command carries the job spec), or write --yaml."""
    if job_spec.yaml:
        return write_yaml(job_spec, out)
    command = job_spec.job_type
    try:
        manifest = access.master_job(job_spec, mf.port_base())
    except ValueError as e:
        return _error(command, str(e), USAGE)
    from kubernetes import client

    from elasticdl.cluster.k8s_api import API_ERRORS, REQUEST_TIMEOUT, api_error, is_status

    try:
        with _core(kubeconfig) as core:
            if _master_pods(core, job_spec.job_name, job_spec.namespace):
                raise client.ApiException(status=409, reason="Conflict")  # an older job
            body = client.V1Job.from_dict(manifest)
            assert body is not None
            client.BatchV1Api(core.api_client).create_namespaced_job(
                job_spec.namespace, body, _request_timeout=REQUEST_TIMEOUT)
    except ClusterError as e:
        return _error(command, str(e), _cluster_error_code(e))
    except API_ERRORS as e:
        if is_status(e, 409):
            return _error(command, f"job {job_spec.job_name} already exists in namespace "
                          f"{job_spec.namespace}; pick another --job_name or run "
                          f"`elasticdl stop {job_spec.job_name}`", API_FAILED)
        err = api_error(e, f"create the master Job in namespace {job_spec.namespace}")
        return _error(command, str(err), _cluster_error_code(err))
    print(f"submitted job {job_spec.job_name}: master Job {manifest['metadata']['name']} "
          f"(restarts the master up to {manifest['spec']['backoffLimit']} times) in "
          f"namespace {job_spec.namespace}\n"
          f"  elasticdl status {job_spec.job_name} --namespace={job_spec.namespace}\n"
          f"  elasticdl logs {job_spec.job_name} --replica=master --follow", file=out)
    return OK


def _describe(pod: dict[str, Any]) -> tuple[str, str, str, str]:
    from elasticdl.cluster.pod_status import pod_state, replica_of

    replica = replica_of(pod)
    name = f"{replica[0].value}-{replica[1]}" if replica else pod["metadata"]["name"]
    if replica and replica[0] == ReplicaType.MASTER:
        name = "master"
    state = pod_state(pod)
    code = "" if state.exit_code is None else str(state.exit_code)
    return name, state.phase.value, state.reason, code


def status(job_name: str, namespace: str = "default", tail: int = 5,
           kubeconfig: Optional[str] = None, out: IO[str] = sys.stdout) -> int:
    """Print each replica's phase, then the tail of the master's log."""
    from elasticdl.cluster.k8s_api import API_ERRORS, api_error, list_pods

    try:
        with _core(kubeconfig) as core:
            raw, _ = list_pods(core, namespace, mf.job_selector(job_name))
            log = _master_log(core, job_name, namespace, tail) if raw and tail > 0 else ""
            figures = live_figures(core, job_name, namespace) if raw else []
    except ClusterError as e:
        return _error("status", str(e), _cluster_error_code(e))
    except API_ERRORS as e:
        err = api_error(e, f"list the pods of job {job_name}")
        return _error("status", str(err), _cluster_error_code(err))
    if not raw:
        return _error("status", f"no job {job_name} in namespace {namespace}", API_FAILED)
    rows = sorted((_describe(p) for p in raw), key=_replica_order)
    print(f"job {job_name} (namespace {namespace})", file=out)
    print(f"  {'REPLICA':<14}{'PHASE':<11}{'REASON':<15}EXIT", file=out)
    for name, phase, reason, code in rows:
        print(f"  {name:<14}{phase:<11}{reason:<15}{code}", file=out)
    for line in figures:
        print(line, file=out)
    if tail > 0:
        print("progress (master log):", file=out)
        for line in log.splitlines():
            print(f"  {line}", file=out)
    return OK


def live_figures(core: Any, job_name: str, namespace: str) -> list[str]:
    """The job's figures from the master's /metrics through the API server's
    service proxy (docs/observability.md); one line saying why when unavailable
    (job ended, --metrics_port=-1, no proxy permission)."""
    from elasticdl.cluster.k8s_api import API_ERRORS
    from elasticdl_client import job_figures

    service = f"{mf.master_service_name(job_name)}:metrics"
    try:
        text = core.connect_get_namespaced_service_proxy_with_path(service, namespace,
                                                                   "metrics")
        lines = job_figures.from_metrics(job_figures.parse(str(text)))
    except API_ERRORS as e:
        reason = getattr(e, "reason", None) or type(e).__name__
        return [f"figures: master metrics endpoint unavailable ({reason})"]
    except ValueError as e:
        return [f"figures: master metrics endpoint sent bad text ({e})"]
    return ["figures (live, master /metrics via the API server):"] + lines


def _master_pods(core: Any, job_name: str, namespace: str) -> list[dict[str, Any]]:
    """The job's master pods (several after master restarts), oldest first."""
    from elasticdl.cluster.k8s_api import list_pods

    selector = f"{mf.job_selector(job_name)},{mf.LABEL_TYPE}={ReplicaType.MASTER.value}"
    pods, _ = list_pods(core, namespace, selector)
    return sorted(pods, key=lambda p: (p["metadata"].get("creationTimestamp") or "",
                                       int(p["metadata"].get("resourceVersion") or 0)))


def current_master(core: Any, job_name: str, namespace: str) -> str:
    """The name of the newest master pod ('' if none)."""
    pods = _master_pods(core, job_name, namespace)
    return str(pods[-1]["metadata"]["name"]) if pods else ""


def _master_log(core: Any, job_name: str, namespace: str, tail: int) -> str:
    from elasticdl.cluster.k8s_api import API_ERRORS, REQUEST_TIMEOUT, api_error

    master = current_master(core, job_name, namespace)
    if not master:
        return "(no master pod)"
    try:
        text = core.read_namespaced_pod_log(master, namespace, tail_lines=tail,
                                            _request_timeout=REQUEST_TIMEOUT)
    except API_ERRORS as e:
        return f"(no master log: {api_error(e, 'read the master log')})"
    return str(text or "")


def _replica_order(row: tuple[str, str, str, str]) -> tuple[int, int, str]:
    kind, _, index = row[0].partition("-")
    rank = {"master": 0, "ps": 1, "worker": 2}.get(kind, 3)
    return rank, int(index) if index.isdigit() else 0, row[0]


def replica_pod_name(job_name: str, replica: str) -> str:
    """``master``, ``ps-0`` or ``worker-3`` -> its pod name; ValueError otherwise."""
    if replica == "master":
        return mf.pod_name(job_name, ReplicaType.MASTER)
    kind, _, index = replica.partition("-")
    if kind not in ("ps", "worker") or not index.isdigit():
        raise ValueError(f"--replica={replica!r}: use master, ps-<i> or worker-<i>")
    return mf.pod_name(job_name, ReplicaType(kind), int(index))


def logs(job_name: str, replica: str = "master", namespace: str = "default",
         follow: bool = False, tail: int = -1, kubeconfig: Optional[str] = None,
         out: IO[str] = sys.stdout) -> int:
    """Print (``follow``: stream until it ends) one replica's log."""
    from elasticdl.cluster.k8s_api import API_ERRORS, REQUEST_TIMEOUT, api_error, is_status

    try:
        name = replica_pod_name(job_name, replica)
    except ValueError as e:
        return _error("logs", str(e), USAGE)
    kwargs: dict[str, Any] = {"tail_lines": tail} if tail >= 0 else {}
    try:
        with _core(kubeconfig) as core:
            if replica == "master":
                name = current_master(core, job_name, namespace) or name
            if not follow:
                text = core.read_namespaced_pod_log(name, namespace, **kwargs,
                                                    _request_timeout=REQUEST_TIMEOUT)
                out.write(str(text or ""))
                return OK
            resp = core.read_namespaced_pod_log(name, namespace, follow=True,
                                                _preload_content=False,
                                                _request_timeout=(REQUEST_TIMEOUT[0], 3600.0),
                                                **kwargs)
            try:
                for chunk in resp.stream(amt=None, decode_content=False):
                    out.write(chunk.decode("utf-8", "replace"))
                    out.flush()
            finally:
                resp.release_conn()
    except ClusterError as e:
        return _error("logs", str(e), _cluster_error_code(e))
    except API_ERRORS as e:
        if is_status(e, 404):
            return _error("logs", f"no pod {name} for {replica} of job {job_name} in "
                          f"namespace {namespace} (see `elasticdl status {job_name}`)",
                          API_FAILED)
        err = api_error(e, f"read the log of {name}")
        return _error("logs", str(err), _cluster_error_code(err))
    return OK


def stop(job_name: str, namespace: str = "default", kubeconfig: Optional[str] = None,
         out: IO[str] = sys.stdout) -> int:
    """Delete the master Job (a job submitted as a bare pod: the master pod); owner
    references remove the master pods, PS, workers, Services and the Secret."""
    from kubernetes import client

    from elasticdl.cluster.k8s_api import API_ERRORS, api_error, delete_object, is_status

    name = mf.master_job_name(job_name)
    body = client.V1DeleteOptions(propagation_policy="Background")
    try:
        with _core(kubeconfig) as core:
            try:
                delete_object(client.BatchV1Api(core.api_client).delete_namespaced_job, name,
                              namespace, body=body)
            except API_ERRORS as e:
                if not is_status(e, 404):
                    raise
                name = mf.pod_name(job_name, ReplicaType.MASTER)  # an older, bare pod
                delete_object(core.delete_namespaced_pod, name, namespace, body=body)
    except ClusterError as e:
        return _error("stop", str(e), _cluster_error_code(e))
    except API_ERRORS as e:
        if is_status(e, 404):
            return _error("stop", f"no job {job_name} in namespace {namespace}", API_FAILED)
        err = api_error(e, f"delete the master pod {name}")
        return _error("stop", str(err), _cluster_error_code(err))
    print(f"stopped job {job_name}: deleted {name}; its replicas and services follow",
          file=out)
    return OK


def rbac(namespace: str = "default", out: IO[str] = sys.stdout) -> int:
    """Print the ServiceAccount, Role and RoleBinding the master pod needs."""
    out.write(access.rbac_yaml(namespace))
    return OK

