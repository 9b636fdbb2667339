"""Master failover on Kubernetes, at the cluster level, on both servers.

The master runs in a ``batch/v1`` Job (the stand-in's test Job controller, or the
genuine kube-controller-manager's). The master process itself is played in this
test process by :meth:`KubernetesCluster.from_job_spec` with the downward-API
environment of the master pod (its pod runs a sleep), so what is proven here is
the backend's part: the master pod is recreated when deleted, a master being
replaced leaves the replicas running, the new master's cluster adopts the same
pods (same uids, same processes) and watches them, the replicas and Services
are owned by the Job, and ``elasticdl stop`` still removes everything.
"""

from __future__ import annotations

import io
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from elasticdl.cluster import k8s_access as access
from elasticdl.cluster import manifests as mf
from elasticdl.cluster.api import Phase, ReplicaEvent, ReplicaSpec, ReplicaType
from elasticdl.cluster.k8s_api import load_api_client
from elasticdl.cluster.kubernetes import KubernetesCluster
from elasticdl.common.job_spec import JobSpec
from elasticdl_client import k8s

pytestmark = pytest.mark.k8s
W, PS = ReplicaType.WORKER, ReplicaType.PS
SLEEP = ["python", "-c", "import time; time.sleep(120)"]
MASTER_SELECTOR = "elasticdl-job-name=f1,elasticdl-replica-type=master"


def job(namespace: str) -> JobSpec:
    return JobSpec(model_zoo="zoo", model_def="m.f", training_data="d", image_name="img:1",
                   job_name="f1", distribution_strategy="ParameterServerStrategy",
                   namespace=namespace)


def wait_until(pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


def wait_event(cluster: KubernetesCluster, seen: list[ReplicaEvent],
               pred: Callable[[ReplicaEvent], bool], timeout_s: float = 30.0) -> ReplicaEvent:
    """Poll events into ``seen`` (kept across calls) until one matches ``pred``."""
    deadline = time.monotonic() + timeout_s
    while True:
        for e in seen:
            if pred(e):
                return e
        if time.monotonic() > deadline:
            break
        seen.extend(cluster.poll_events(0.2))
    raise AssertionError(f"no matching event within {timeout_s} s; saw {seen}")


def submit_master_job(server: Any, port_base: int, command: list[str],
                      restarts: int = 3) -> dict[str, Any]:
    """The client's master Job, with ``command`` in place of the master process."""
    manifest = access.master_job(job(server.namespace), port_base)
    manifest["spec"]["backoffLimit"] = restarts
    manifest["spec"]["template"]["spec"]["containers"][0]["command"] = command
    api = load_api_client(server.kubeconfig)  # as the submitting user
    try:
        client.BatchV1Api(api).create_namespaced_job(server.namespace,
                                                     client.V1Job.from_dict(manifest))
    finally:
        api.close()
    return manifest


def running_masters(server: Any) -> list[str]:
    return [p["metadata"]["name"] for p in server.list("pods", MASTER_SELECTOR)
            if p["status"].get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")]


def master_cluster(server: Any, monkeypatch: Any, port_base: int,
                   master_pod: str) -> KubernetesCluster:
    """The cluster the master process in ``master_pod`` would build."""
    for k, v in {"KUBECONFIG": server.kubeconfig, "MY_POD_NAME": master_pod,
                 "MY_POD_IP": "10.9.8.7", "ELASTICDL_K8S_PORT_BASE": str(port_base),
                 "ELASTICDL_K8S_SERVICE_HOST": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    return KubernetesCluster.from_job_spec(job(server.namespace), "/unused",
                                           watch_timeout_s=5)


def test_deleted_master_pod_is_recreated_and_adopts_the_running_replicas(
        server, kubelet, monkeypatch, port_base):
    ns = server.namespace
    submit_master_job(server, port_base, SLEEP)
    master_job = wait_until(lambda: server.get("jobs", "elasticdl-f1-master"), 10, "the Job")
    first = wait_until(lambda: running_masters(server), 60, "the first master pod")[0]

    c1 = master_cluster(server, monkeypatch, port_base, first)
    assert c1.restartable
    # the master address is the master Service's, stable across master pods
    assert c1.master_address() == f"127.0.0.1:{port_base}"
    svc = server.get("services", "f1-master")
    assert svc["spec"]["selector"] == mf.labels("f1", ReplicaType.MASTER, 0)
    port, address = c1.endpoint(PS, 0)
    c1.create_replica(ReplicaSpec("f1", PS, 0, tuple(SLEEP), port=port))
    for i in (0, 1):
        c1.create_replica(ReplicaSpec("f1", W, i, tuple(SLEEP)))
    seen: list[ReplicaEvent] = []
    for name in ("ps-0", "worker-0", "worker-1"):
        wait_event(c1, seen, lambda e, n=name: e.name == n and e.phase == Phase.RUNNING, 60)
    replicas = {n: server.get("pods", f"elasticdl-f1-{n}") for n in ("ps-0", "worker-0",
                                                                     "worker-1")}
    for obj in [*replicas.values(), server.get("services", "f1-ps-0"), svc]:
        assert obj["metadata"].get("ownerReferences"), obj["metadata"]
        ref = obj["metadata"]["ownerReferences"][0]  # the Job: they outlive a master pod
        assert (ref["kind"], ref["uid"]) == ("Job", master_job["metadata"]["uid"])
        assert not ref.get("controller")  # else the Job controller releases them
    pids = {n: kubelet.pid(ns, f"elasticdl-f1-{n}") for n in replicas}

    # the master pod is evicted: SIGTERM reaches the master, which closes its cluster
    client.CoreV1Api(server.admin).delete_namespaced_pod(first, ns)
    c1.close()
    # while no master runs, a worker dies
    kubelet.kill(ns, "elasticdl-f1-worker-1", signal.SIGKILL)
    wait_until(lambda: server.phase("elasticdl-f1-worker-1") == "Failed", 30,
               "worker-1 to fail")
    second = wait_until(lambda: [m for m in running_masters(server) if m != first], 60,
                        "the Job controller to recreate the master pod")[0]
    for name in ("ps-0", "worker-0"):  # the same processes, never restarted
        assert kubelet.pid(ns, f"elasticdl-f1-{name}") == pids[name]
        assert server.phase(f"elasticdl-f1-{name}") == "Running"

    c2 = master_cluster(server, monkeypatch, port_base, second)
    try:
        adopted = {r.name: r for r in c2.adopt_replicas()}
        assert set(adopted) == {"ps-0", "worker-0"}  # worker-1 ended: not adopted
        for name, info in adopted.items():
            assert info.ident == replicas[name]["metadata"]["uid"]  # the same pods
            assert info.phase == Phase.RUNNING
        assert (adopted["ps-0"].port, adopted["ps-0"].address) == (port, address)
        assert c2.master_address() == f"127.0.0.1:{port_base}"
        assert c2.poll_events(0.5) == []  # old endings are not replayed as news
        # the adopted pods are watched as if this master had created them
        kubelet.kill(ns, "elasticdl-f1-worker-0", signal.SIGKILL)
        event = wait_event(c2, [], lambda e: e.name == "worker-0" and e.phase == Phase.FAILED)
        assert event.reason == "killed"
    finally:
        c2.close()  # a normal end: the live replicas go (the PS), finished pods stay
    def ps_going() -> bool:  # read once: the pod may vanish between two reads
        pod = server.get("pods", "elasticdl-f1-ps-0")
        return pod is None or bool(pod["metadata"].get("deletionTimestamp"))

    wait_until(ps_going, 30, "the adopted PS to be deleted on close")
    assert server.get("services", "f1-ps-0") is None

    # `elasticdl stop` deletes the Job; the garbage collector removes the rest
    assert k8s.stop("f1", ns, server.kubeconfig, out=io.StringIO()) == 0
    wait_until(lambda: not server.list("pods") and not server.list("services")
               and not server.list("jobs") and not kubelet.running(), 90,
               "the cascade from the master Job")


def test_master_restarts_are_bounded_by_the_backoff_limit(server, kubelet, port_base):
    fail = ["python", "-c", "import sys; sys.exit(7)"]
    submit_master_job(server, port_base, fail, restarts=1)

    def failed() -> bool:
        obj = server.get("jobs", "elasticdl-f1-master") or {}
        return any(c.get("type") == "Failed" and c.get("status") == "True"
                   for c in (obj.get("status") or {}).get("conditions") or [])

    wait_until(failed, 90, "the Job to fail after its backoff limit")
    pods = server.list("pods", MASTER_SELECTOR)
    assert [p["status"]["phase"] for p in pods] == ["Failed", "Failed"]  # 1 + 1 restart
    assert k8s.stop("f1", server.namespace, server.kubeconfig, out=io.StringIO()) == 0
    wait_until(lambda: not server.list("pods") and not server.list("jobs"), 60,
               "the failed job's pods to go")


def test_detach_keeps_replicas_and_a_new_cluster_adopts_them(server, kubelet):
    """Without a Job (no owner): ``detach()`` leaves the pods; a later cluster of the
    same job adopts the live ones and ``close()`` deletes them."""
    from elasticdl.cluster.kubernetes import create

    spec = job(server.namespace)
    c1 = create(spec, server.kubeconfig, watch_timeout_s=5)
    seen: list[ReplicaEvent] = []
    for i in (0, 1):
        c1.create_replica(ReplicaSpec("f1", W, i, tuple(SLEEP)))
    for i in (0, 1):
        wait_event(c1, seen, lambda e, n=f"worker-{i}": e.name == n and e.phase == Phase.RUNNING,
                   60)
    uids = {i: server.get("pods", f"elasticdl-f1-worker-{i}")["metadata"]["uid"] for i in (0, 1)}
    c1.detach()
    client.CoreV1Api(server.admin).delete_namespaced_pod("elasticdl-f1-worker-1",
                                                        server.namespace)
    c2 = create(spec, server.kubeconfig, watch_timeout_s=5)
    try:
        adopted = c2.adopt_replicas()
        assert [(r.name, r.ident) for r in adopted] == [("worker-0", uids[0])]
        assert server.phase("elasticdl-f1-worker-0") == "Running"
    finally:
        c2.close()
    wait_until(lambda: not server.list("pods") and not kubelet.running(), 30,
               "the adopted worker to be deleted on close")
