"""``KubernetesCluster``: replicas as pods, watched through the API server.

The master pod builds one with :meth:`KubernetesCluster.from_job_spec`. It
creates PS and worker pods (and one ClusterIP Service per PS, whose DNS name
is the PS address) owned by the master pod, so deleting the master deletes the
job. A :class:`~elasticdl.cluster.k8s_watch.PodWatcher` lists the job's pods, then
watches them (resuming after drops, listing again after ``410 Gone``); pod
statuses become :class:`ReplicaEvent` s per :mod:`elasticdl.cluster.pod_status`.

Environment read by :meth:`from_job_spec` (set by Kubernetes or the stand-in
test kubelet): ``MY_POD_NAME`` and ``MY_POD_IP`` (downward API) name the
master pod and give the master address; ``$ELASTICDL_K8S_PORT_BASE`` moves the
ports (see :mod:`~elasticdl.cluster.manifests`); ``$ELASTICDL_K8S_SERVICE_HOST``,
when set, replaces Service DNS names in addresses (the stand-in has no DNS).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from kubernetes import client

from elasticdl.cluster import k8s_access as access
from elasticdl.cluster import manifests as mf
from elasticdl.cluster.api import (
    Cluster,
    ClusterError,
    Phase,
    ReplicaEvent,
    ReplicaInfo,
    ReplicaSpec,
    ReplicaType,
)
from elasticdl.cluster.k8s_api import (
    API_ERRORS,
    REQUEST_TIMEOUT,
    api_error,
    delete_object,
    is_status,
    load_api_client,
    to_model,
    uid_of,
)
from elasticdl.cluster.k8s_objects import JobObjects
from elasticdl.cluster.k8s_preemption import preemption_message
from elasticdl.cluster.k8s_watch import PodWatcher
from elasticdl.cluster.pod_status import Pod, PodState, pod_state, replica_of
from elasticdl.common import auth
from elasticdl.common.job_spec import JobSpec

logger = logging.getLogger(__name__)

SERVICE_HOST_ENV = "ELASTICDL_K8S_SERVICE_HOST"
SCALE_ANNOTATION = "elasticdl.org/num-workers"   # elasticdl scale (elasticdl_client/scale.py)


@dataclass
class _Tracked:
    """One pod incarnation (by uid) and what was last reported about it."""

    name: str
    type: ReplicaType
    index: int
    pod: Pod
    state: Optional[PodState] = None
    high_priority: bool = False


class KubernetesCluster(Cluster):
    """Replicas of one job as pods in ``job_spec.namespace``.

    ``owner`` is ``(name, uid)`` of the master pod, or ``owner_ref`` a ready
    reference (the master Job, see :func:`~elasticdl.cluster.manifests.master_job`);
    every pod, Service and Secret made here references it. With a Job as owner the
    master is restartable: its address is the master Service, and replicas outlive
    one master pod. Raises ClusterError (PermissionDenied for 403) if the job's pods
    cannot be listed.

    Pods that exist when the cluster starts produce no events (their endings were
    its predecessor's business); :meth:`adopt_replicas` returns those still live.
    """

    def __init__(self, job_spec: JobSpec, api_client: client.ApiClient, *,
                 owner: Optional[tuple[str, str]] = None, port_base: int = mf.DEFAULT_PORT_BASE,
                 service_host: str = "", pod_ip: str = "", watch_timeout_s: int = 60,
                 log_tail_lines: int = 30, delete_wait_s: float = 60.0,
                 job_secrets: Optional[auth.JobSecrets] = None,
                 owner_ref: Optional[mf.Manifest] = None, master_pod: str = ""):
        self.job_spec = job_spec
        self.namespace = job_spec.namespace
        self._api_client = api_client
        self._core = client.CoreV1Api(api_client)
        self._owner = owner_ref or (mf.owner_reference(*owner) if owner else None)
        self._objects = JobObjects(self._core, job_spec, self._owner, job_secrets, port_base)
        self._master_pod = master_pod or (owner[0] if owner else "")
        self._detached = False
        self._quiet = True  # the first list: record pods, report nothing
        self._port_base = port_base
        self._service_host = service_host
        self._pod_ip = pod_ip
        self._watch_timeout_s = max(1, int(watch_timeout_s))
        self._log_tail_lines = log_tail_lines
        self._delete_wait_s = delete_wait_s
        self._selector = mf.job_selector(job_spec.job_name)
        self._lock = threading.RLock()
        self._pods: dict[str, _Tracked] = {}  # by uid
        self._deleted_here: set[str] = set()   # pods this master deleted (not preempted)
        self._requested_workers: Optional[str] = None
        self._created: dict[str, str] = {}  # pod name -> uid of the incarnation we made
        self._events: queue.Queue[ReplicaEvent] = queue.Queue()
        self._closed = threading.Event()
        self._watcher = PodWatcher(self._core, self.namespace, self._selector,
                                   self._watch_timeout_s, self._on_pod, self._reconcile)
        rv = self._watcher.relist()
        self._quiet = False
        self._watcher.start(rv)

    @property
    def restartable(self) -> bool:
        """The master runs in a Job that recreates it (see the class docstring)."""
        return bool(self._owner and self._owner.get("kind") == "Job")

    @classmethod
    def from_job_spec(cls, job_spec: JobSpec, job_dir: Optional[str] = None,
                      **kwargs: Any) -> KubernetesCluster:
        """The cluster of the master pod this process runs in.

        ``job_dir`` is unused (pods keep their own logs). Raises KubeConfigError
        without a configuration, ClusterError if the master pod is unreadable.
        """
        del job_dir
        api_client = load_api_client()
        owner = None
        master = os.environ.get("MY_POD_NAME", "")
        if master:
            try:
                pod = client.CoreV1Api(api_client).read_namespaced_pod(
                    master, job_spec.namespace, _request_timeout=REQUEST_TIMEOUT)
            except API_ERRORS as e:
                raise api_error(e, f"read the master pod {master}") from None
            owner = (master, uid_of(pod))
            job = next((r for r in getattr(pod.metadata, "owner_references", None) or []
                        if r.kind == "Job" and r.controller), None)
            if job is not None:  # a restartable master: the Job is the job's root
                kwargs.setdefault("owner_ref", mf.owner_reference(job.name, job.uid, "Job"))
        else:
            logger.warning("MY_POD_NAME is not set: replicas get no owner reference and "
                           "survive the master unless it closes the cluster")
        kwargs.setdefault("job_secrets", auth.JobSecrets.from_env())
        cluster = cls(job_spec, api_client, owner=owner, port_base=mf.port_base(),
                      service_host=os.environ.get(SERVICE_HOST_ENV, ""),
                      pod_ip=os.environ.get("MY_POD_IP", ""), **kwargs)
        if cluster.restartable:
            try:
                cluster._objects.ensure_master_service()
            except ClusterError:
                cluster.close()
                raise
        return cluster

    # ------------------------------------------------------------ Cluster API
    def endpoint(self, type: ReplicaType, index: int) -> tuple[int, str]:
        """PS: its Service's ``<svc>.<ns>.svc:<port>``; master: pod IP; workers
        have no address before they run (they advertise ``$MY_POD_IP``)."""
        port = mf.replica_port(self._port_base, type, index)
        if type == ReplicaType.PS:
            host = self._service_host or (
                f"{mf.ps_service_name(self.job_spec.job_name, index)}.{self.namespace}.svc")
            return port, f"{host}:{port}"
        if type == ReplicaType.MASTER:
            return port, self.master_address() or ""
        return port, ""

    def master_address(self) -> Optional[str]:
        """The master Service's ``<svc>.<ns>.svc:<port>`` when the master is
        restartable (a restarted master gets a new pod IP), else ``$MY_POD_IP:<port>``."""
        port = mf.replica_port(self._port_base, ReplicaType.MASTER, 0)
        if self.restartable:
            host = self._service_host or (
                f"{mf.master_service_name(self.job_spec.job_name)}.{self.namespace}.svc")
            return f"{host}:{port}"
        if not self._pod_ip:
            return None
        return f"{self._pod_ip}:{port}"

    def requested_workers(self) -> Optional[str]:
        return self._requested_workers

    def adopt_replicas(self) -> list[ReplicaInfo]:
        """The job's PS and worker pods that are pending or running and not being
        deleted, found by the job's labels; from now on this cluster reports their
        events and deletes them on :meth:`close` as if it had created them."""
        adopted = []
        with self._lock:
            for uid, t in sorted(self._pods.items(), key=lambda kv: kv[1].name):
                meta = t.pod.get("metadata") or {}
                if t.state is None or t.state.terminal or meta.get("deletionTimestamp"):
                    continue
                self._created[t.name] = uid
                t.high_priority = (t.pod.get("spec") or {}).get("priorityClassName") == "high"
                port, address = 0, ""
                if t.type == ReplicaType.PS:
                    port, address = self.endpoint(t.type, t.index)
                    self._objects.adopt_service(mf.ps_service_name(self.job_spec.job_name,
                                                                   t.index))
                adopted.append(ReplicaInfo(t.type, t.index, t.state.phase, port, address, uid))
        logger.info("adopted %d running replica(s): %s", len(adopted),
                    ", ".join(f"{r.name} (pod uid {r.ident})" for r in adopted) or "none")
        return adopted

    def finished_replicas(self) -> dict[tuple[ReplicaType, int], tuple[Phase, Optional[int]]]:
        out: dict[tuple[ReplicaType, int], tuple[Phase, Optional[int]]] = {}
        with self._lock:
            for t in self._pods.values():
                meta = t.pod.get("metadata") or {}
                if t.state is not None and t.state.terminal and \
                        not meta.get("deletionTimestamp"):
                    out[(t.type, t.index)] = (t.state.phase, t.state.exit_code)
        return out

    def detach(self) -> None:
        """Stop watching and keep every replica: this master is going away and its
        successor adopts them (see :meth:`close`)."""
        self._detached = True
        self.close()

    def create_replica(self, spec: ReplicaSpec) -> None:
        if self._closed.is_set():
            raise ClusterError("cluster is closed")
        if spec.type == ReplicaType.MASTER:
            raise ClusterError("the master pod is created by the client, not the cluster")
        high = self._choose_high(spec)
        try:
            priority = mf.resolve_priority(
                spec.priority or getattr(self.job_spec, f"{spec.type.value}_pod_priority"),
                spec.type, high)
            manifest = mf.replica_pod(self.job_spec, spec, priority, self._owner)
        except ValueError as e:
            raise ClusterError(f"cannot build the pod of {spec.name}: {e}") from None
        if self._objects.has_secret:
            access.with_secret_env(manifest, self.job_spec.job_name,
                                   self._objects.ensure_secret())
        if spec.type == ReplicaType.PS and spec.port:
            self._objects.ensure_ps_service(spec.index, spec.port)
        name = manifest["metadata"]["name"]
        pod = self._create_pod(spec.name, manifest)
        uid = uid_of(pod)
        with self._lock:
            self._created[name] = uid
            self._deleted_here.discard(name)
            tracked = self._pods.setdefault(uid, _Tracked(name, spec.type, spec.index, {}))
            tracked.high_priority = priority == "high"
        logger.info("created pod %s (%s)%s", name, spec.name,
                    f", priority class {priority}" if priority else "")

    def delete_replica(self, type: ReplicaType, index: int) -> None:
        name = mf.pod_name(self.job_spec.job_name, type, index)
        self._delete_pod(name)

    def poll_events(self, timeout_s: float) -> list[ReplicaEvent]:
        events = []
        try:
            events.append(self._events.get(timeout=max(0.0, timeout_s)))
            while True:
                events.append(self._events.get_nowait())
        except queue.Empty:
            pass
        return events

    def close(self) -> None:
        """Stop watching; delete live replicas and the PS Services.

        Finished pods stay for ``elasticdl logs`` when the master pod owns them
        (deleting the master removes them); without an owner all are deleted.
        Deletion failures are logged, not raised: owner references still clean
        up when the master pod goes.

        A restartable master keeps every replica when it is being replaced: after
        :meth:`detach`, or when its own pod is being deleted (eviction, preemption,
        ``kubectl delete pod``: SIGTERM reaches the master) while its Job is not;
        the Job then starts a new master that adopts them. ``elasticdl stop``
        deletes the Job, and the garbage collector removes the replicas.
        """
        if self._closed.is_set():
            return
        self._closed.set()
        self._watcher.stop(self._watch_timeout_s + 15)
        if self._detached or self._being_replaced():
            logger.warning("master pod %s is being replaced: leaving the replicas running "
                           "for the next master", self._master_pod or "(unknown)")
            self._api_client.close()
            return
        with self._lock:
            live = {name for name, uid in self._created.items()
                    if self._owner is None or not self._is_terminal(uid)}
        failed = []
        for name in sorted(live):
            if not self._delete_pod(name, quiet=True):
                failed.append(name)
        failed += self._objects.delete()
        if failed:
            logger.error("could not delete %s; they go when the master pod is deleted",
                         ", ".join(failed))
        self._api_client.close()

    # ------------------------------------------------------------ API calls
    def _being_replaced(self) -> bool:
        """A restartable master whose pod is deleted (or gone) will be recreated."""
        if not self.restartable or not self._master_pod:
            return False
        try:
            pod = self._core.read_namespaced_pod(self._master_pod, self.namespace,
                                                 _request_timeout=REQUEST_TIMEOUT)
        except API_ERRORS as e:
            if is_status(e, 404):
                return True
            logger.error("%s; deleting the replicas", api_error(e, "read the master pod"))
            return False
        return getattr(pod.metadata, "deletion_timestamp", None) is not None

    def _create_pod(self, replica: str, manifest: mf.Manifest) -> client.V1Pod:
        name = manifest["metadata"]["name"]
        body = to_model(client.V1Pod, manifest)
        for attempt in (1, 2):
            try:
                return self._core.create_namespaced_pod(self.namespace, body,
                                                        _request_timeout=REQUEST_TIMEOUT)
            except API_ERRORS as e:
                if not is_status(e, 409) or attempt == 2:
                    raise api_error(e, f"create pod {name} for {replica}") from None
            self._replace_finished(name, replica)
        raise AssertionError("unreachable")

    def _replace_finished(self, name: str, replica: str) -> None:
        """A pod of the same name exists (a PS relaunch): remove it if finished."""
        try:
            old = self._core.read_namespaced_pod(name, self.namespace,
                                                 _request_timeout=REQUEST_TIMEOUT)
        except API_ERRORS as e:
            if is_status(e, 404):
                return
            raise api_error(e, f"read pod {name}") from None
        raw = self._api_client.sanitize_for_serialization(old)
        if not pod_state(raw).terminal and not raw["metadata"].get("deletionTimestamp"):
            raise ClusterError(f"{replica} is still running as pod {name}; delete it first")
        self._delete_pod(name)
        deadline = time.monotonic() + self._delete_wait_s
        while time.monotonic() < deadline:
            try:
                self._core.read_namespaced_pod(name, self.namespace,
                                               _request_timeout=REQUEST_TIMEOUT)
            except API_ERRORS as e:
                if is_status(e, 404):
                    return
                raise api_error(e, f"read pod {name}") from None
            time.sleep(0.2)
        raise ClusterError(f"old pod {name} was not removed within {self._delete_wait_s:.0f} s")

    def _delete_pod(self, name: str, quiet: bool = False) -> bool:
        with self._lock:
            self._deleted_here.add(name)  # bounded by the job's pods (names are unique)
        try:
            delete_object(self._core.delete_namespaced_pod, name, self.namespace,
                          body=client.V1DeleteOptions(propagation_policy="Background"))
            logger.info("deleted pod %s", name)
        except API_ERRORS as e:
            if is_status(e, 404):
                return True
            if quiet:
                logger.error("%s", api_error(e, f"delete pod {name}"))
                return False
            raise api_error(e, f"delete pod {name}") from None
        return True

    def _log_tail(self, name: str) -> str:
        if self._log_tail_lines <= 0:
            return ""
        try:
            text = self._core.read_namespaced_pod_log(
                name, self.namespace, tail_lines=self._log_tail_lines,
                _request_timeout=REQUEST_TIMEOUT)
        except API_ERRORS as e:
            logger.info("no log of %s: %s", name, api_error(e, "read the log"))
            return ""
        return str(text or "")

    # ------------------------------------------------------------ priorities
    def _choose_high(self, spec: ReplicaSpec) -> bool:
        """For ``--worker_pod_priority=<fraction>``: keep that share of live workers high."""
        if spec.type != ReplicaType.WORKER:
            return False
        try:
            fraction = mf.parse_fraction(spec.priority or self.job_spec.worker_pod_priority)
        except ValueError as e:
            raise ClusterError(str(e)) from None
        if fraction is None:
            return False
        target = int(fraction * self.job_spec.num_workers + 0.5)
        with self._lock:
            high = sum(1 for t in self._pods.values() if t.type == ReplicaType.WORKER
                       and t.high_priority and not (t.state and t.state.terminal))
        return high < target

    # ------------------------------------------------------------ watching
    def _is_terminal(self, uid: str) -> bool:
        tracked = self._pods.get(uid)
        return bool(tracked and tracked.state and tracked.state.terminal)

    def _reconcile(self, seen: set[str]) -> None:
        """After a list: pods we track that the list no longer has were deleted
        while we were not watching."""
        with self._lock:
            gone = [t for uid, t in self._pods.items() if uid not in seen and t.pod]
        for tracked in gone:
            self._on_pod(tracked.pod, deleted=True)

    def _on_pod(self, pod: Pod, deleted: bool) -> None:
        replica = replica_of(pod)
        if replica is not None and replica[0] == ReplicaType.MASTER and not deleted:
            wanted = ((pod.get("metadata") or {}).get("annotations") or {}).get(
                SCALE_ANNOTATION)
            if wanted:
                self._requested_workers = str(wanted)
        if replica is None or replica[0] == ReplicaType.MASTER:
            return
        meta = pod.get("metadata") or {}
        uid, name = str(meta.get("uid")), str(meta.get("name"))
        state = pod_state(pod, deleted)
        with self._lock:
            tracked = self._pods.setdefault(uid, _Tracked(name, *replica, pod))
            tracked.pod = pod
            prev = tracked.state
            if self._quiet:
                tracked.state = state
                return
            if prev is not None and (prev.terminal or
                                     (prev.phase, prev.reason) == (state.phase, state.reason)):
                return  # nothing new; a finished pod's later deletion is not news
            tracked.state = state
        message = state.message
        if state.reason in ("error", "oom"):
            tail = self._log_tail(name)
            message = f"{message}\n{tail}".strip() if tail else message
        event = ReplicaEvent(replica[0], replica[1], state.phase, state.exit_code,
                             state.reason, message)
        if state.phase == Phase.DELETED and state.message.startswith("pod disrupted: Preemption"):
            event = dataclasses.replace(event, reason="preempted")
        elif state.phase == Phase.DELETED and state.reason == "deleted" and \
                (pod.get("spec") or {}).get("nodeName") and name not in self._deleted_here:
            threading.Thread(target=self._deleted, args=(event, name, uid), daemon=True,
                             name=f"preempted-{name}").start()
            return
        self._emit(event, name, state)

    def _deleted(self, event: ReplicaEvent, name: str, uid: str) -> None:
        """A bound pod was deleted: preempted (the scheduler's Event), or a plain delete."""
        message = preemption_message(self._core, self.namespace, uid)
        if message:
            event = dataclasses.replace(event, reason="preempted", message=message)
        self._emit(event, name, PodState(event.phase, event.reason, event.exit_code))

    def _emit(self, event: ReplicaEvent, name: str, state: PodState) -> None:
        logger.info("%s (pod %s): %s%s%s", event.name, name, state.phase.value,
                    f" ({state.reason})" if state.reason else "",
                    f" exit {state.exit_code}" if state.exit_code is not None else "")
        self._events.put(event)


def create(job_spec: JobSpec, kubeconfig: Optional[str] = None,
           **kwargs: Any) -> KubernetesCluster:
    """A cluster from an explicit kubeconfig, without an owner (tests, tools)."""
    return KubernetesCluster(job_spec, load_api_client(kubeconfig), **kwargs)
