"""KubernetesCluster against the stand-in API server or a genuine one, and the test kubelet.

Each test runs real processes as "pods" and checks the ReplicaEvents the
master would see: exit codes and reasons, deletion, watch resumption after a
dropped connection and after 410 Gone, owner-reference cascade, clear errors.
Tests taking ``server`` run on both servers (``k8s_real`` for the genuine one);
on a real server deletion is graceful (Terminating until the kubelet confirms)
and garbage collection asynchronous, so those tests wait for the effect.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from elasticdl.cluster.api import Phase, ReplicaEvent, ReplicaSpec, ReplicaType
from elasticdl.cluster.k8s_api import KubeConfigError, PermissionDenied
from elasticdl.cluster.kubernetes import KubernetesCluster, create
from elasticdl.cluster.manifests import pod_name
from elasticdl.common.job_spec import JobSpec

pytestmark = pytest.mark.k8s
W, PS = ReplicaType.WORKER, ReplicaType.PS
SLEEP = ("python", "-c", "import time; time.sleep(60)")


def job(**kw: object) -> JobSpec:
    base = dict(model_zoo="zoo", model_def="m.f", training_data="d", image_name="img:1",
                job_name="t1", distribution_strategy="ParameterServerStrategy")
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def replica(type: ReplicaType, index: int, command: tuple[str, ...] = SLEEP,
            **kw: object) -> ReplicaSpec:
    return ReplicaSpec("t1", type, index, command, **kw)  # type: ignore[arg-type]


def wait_for(cluster: KubernetesCluster, seen: list[ReplicaEvent],
             pred: Callable[[ReplicaEvent], bool], timeout_s: float = 30.0) -> ReplicaEvent:
    """Poll events into ``seen`` until one matches ``pred``."""
    deadline = time.monotonic() + timeout_s
    checked = 0
    while True:
        for e in seen[checked:]:
            if pred(e):
                return e
        checked = len(seen)
        if time.monotonic() > deadline:
            break
        seen.extend(cluster.poll_events(0.2))
    raise AssertionError(f"no matching event within {timeout_s} s; saw {seen}")


def phase_is(name: str, phase: Phase) -> Callable[[ReplicaEvent], bool]:
    return lambda e: e.name == name and e.phase == phase


def wait_until(pred: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def cluster(server, kubelet) -> Iterator[KubernetesCluster]:
    c = create(job(namespace=server.namespace), server.kubeconfig, watch_timeout_s=5)
    yield c
    c.close()


def test_exit_codes_become_reasons(cluster, kubelet, server):
    seen: list[ReplicaEvent] = []
    fail = ("python", "-c", "import sys; print('boom: bad shard'); sys.exit(3)")
    cluster.create_replica(replica(W, 0, fail))
    cluster.create_replica(replica(W, 1, ("python", "-c", "pass")))
    e = wait_for(cluster, seen, phase_is("worker-0", Phase.FAILED))
    assert (e.reason, e.exit_code) == ("error", 3)
    assert "boom: bad shard" in e.message  # the log tail travels with the event
    e = wait_for(cluster, seen, phase_is("worker-1", Phase.SUCCEEDED))
    assert (e.reason, e.exit_code) == ("completed", 0)
    assert [x.phase for x in seen if x.name == "worker-1"][-2:] == [Phase.RUNNING,
                                                                     Phase.SUCCEEDED]


def test_kill9_oom_and_eviction(cluster, kubelet, server):
    seen: list[ReplicaEvent] = []
    for i in range(3):
        cluster.create_replica(replica(W, i))
    for i in range(3):
        wait_for(cluster, seen, phase_is(f"worker-{i}", Phase.RUNNING))
    kubelet.kill(server.namespace, pod_name("t1", W, 0), signal.SIGKILL)
    kubelet.oom_kill(server.namespace, pod_name("t1", W, 1))
    kubelet.evict(server.namespace, pod_name("t1", W, 2))
    got = {i: wait_for(cluster, seen, phase_is(f"worker-{i}", Phase.FAILED)) for i in range(3)}
    assert (got[0].reason, got[0].exit_code) == ("killed", 137)
    assert (got[1].reason, got[1].exit_code) == ("oom", 137)
    assert got[2].reason == "killed" and "low on resource" in got[2].message


def test_deletion_by_someone_else_and_by_the_master(cluster, kubelet, api_client, server):
    from kubernetes import client

    seen: list[ReplicaEvent] = []
    cluster.create_replica(replica(W, 0))
    cluster.create_replica(replica(W, 1))
    wait_for(cluster, seen, phase_is("worker-1", Phase.RUNNING))
    wait_for(cluster, seen, phase_is("worker-0", Phase.RUNNING))
    pid = kubelet.pid(server.namespace, pod_name("t1", W, 0))
    client.CoreV1Api(api_client).delete_namespaced_pod(pod_name("t1", W, 0), server.namespace)
    e = wait_for(cluster, seen, phase_is("worker-0", Phase.DELETED))
    assert e.reason == "deleted"
    cluster.delete_replica(W, 1)
    assert wait_for(cluster, seen, phase_is("worker-1", Phase.DELETED)).reason == "deleted"
    deadline = time.monotonic() + 10
    while kubelet.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kubelet.running() == [], f"process {pid} of the deleted pod still runs"
    # a real server keeps them Terminating until the kubelet confirms: wait, do not assume
    wait_until(lambda: not server.list("pods"), 30, "the deleted pods to go")
    cluster.delete_replica(W, 7)  # already gone: no error


def test_watch_resumes_after_dropped_connection(cluster, kubelet, apiserver):
    seen: list[ReplicaEvent] = []
    cluster.create_replica(replica(W, 0))
    wait_for(cluster, seen, phase_is("worker-0", Phase.RUNNING))
    n_watches = sum(1 for m, p in apiserver.requests if "watch=" in p)
    apiserver.drop_watches()
    kubelet.kill("default", pod_name("t1", W, 0))
    e = wait_for(cluster, seen, phase_is("worker-0", Phase.FAILED))
    assert e.reason == "killed"
    resumed = [p for m, p in apiserver.requests if "watch=" in p][n_watches:]
    assert resumed and all("resourceVersion=" in p for p in resumed)


def test_watch_relists_after_410_gone(cluster, kubelet, apiserver):
    seen: list[ReplicaEvent] = []
    cluster.create_replica(replica(W, 0))
    cluster.create_replica(replica(W, 1))
    wait_for(cluster, seen, phase_is("worker-0", Phase.RUNNING))
    wait_for(cluster, seen, phase_is("worker-1", Phase.RUNNING))
    apiserver.forbidden = True  # the cluster cannot watch for a moment...
    apiserver.drop_watches()
    kubelet.kill("default", pod_name("t1", W, 0))
    pod1 = apiserver.get("pods", "default", pod_name("t1", W, 1))
    apiserver.delete("pods", "default", pod1["metadata"]["name"])
    deadline = time.monotonic() + 10
    while (apiserver.get("pods", "default", pod_name("t1", W, 0))["status"]["phase"]
           != "Failed" and time.monotonic() < deadline):
        time.sleep(0.05)
    apiserver.compact()  # ...and its resourceVersion is gone when it is back
    n_requests = len(apiserver.requests)
    apiserver.forbidden = False
    assert wait_for(cluster, seen, phase_is("worker-0", Phase.FAILED)).reason == "killed"
    assert wait_for(cluster, seen, phase_is("worker-1", Phase.DELETED)).reason == "deleted"
    lists = [p for m, p in apiserver.requests[n_requests:]
             if m == "GET" and "/namespaces/default/pods?" in p and "watch=" not in p]
    assert lists, "the cluster did not list again after 410 Gone"


def test_ps_service_owner_refs_and_cascade(server, kubelet, api_client):
    from kubernetes import client

    ns = server.namespace
    core = client.CoreV1Api(api_client)
    master = core.create_namespaced_pod(ns, client.V1Pod.from_dict({
        "metadata": {"name": pod_name("t1", ReplicaType.MASTER), "labels": {"app": "x"}},
        "spec": {"containers": [{"name": "m", "image": "img", "command": list(SLEEP)}]}}))
    c = KubernetesCluster(job(namespace=ns), api_client,
                          owner=(master.metadata.name, master.metadata.uid), watch_timeout_s=5)
    try:
        seen: list[ReplicaEvent] = []
        port, address = c.endpoint(PS, 0)
        assert address == f"t1-ps-0.{ns}.svc:{port}"
        c.create_replica(replica(PS, 0, port=port))
        c.create_replica(replica(W, 0))
        wait_for(c, seen, phase_is("ps-0", Phase.RUNNING), 30)
        wait_for(c, seen, phase_is("worker-0", Phase.RUNNING), 30)
        svc = server.get("services", "t1-ps-0")
        assert svc is not None and svc["spec"]["ports"][0]["port"] == port
        assert svc["spec"]["selector"]["elasticdl-replica-index"] == "0"
        for obj in (svc, server.get("pods", pod_name("t1", W, 0))):
            assert obj["metadata"]["ownerReferences"][0]["uid"] == master.metadata.uid
        # a failed PS is relaunched under the same name (and keeps its Service)
        kubelet.kill(ns, pod_name("t1", PS, 0))
        wait_for(c, seen, phase_is("ps-0", Phase.FAILED), 30)
        c.create_replica(replica(PS, 0, port=port))
        wait_for(c, [], phase_is("ps-0", Phase.RUNNING), 30)
        core.delete_namespaced_pod(master.metadata.name, ns)
        # garbage collection is asynchronous on a real server: wait for its effect
        wait_until(lambda: not server.list("pods") and not server.list("services")
                   and not kubelet.running(), 60, "the owner-reference cascade")
    finally:
        c.close()


def test_close_deletes_live_replicas(server, kubelet):
    c = create(job(namespace=server.namespace), server.kubeconfig, watch_timeout_s=5)
    seen: list[ReplicaEvent] = []
    port, _ = c.endpoint(PS, 0)
    c.create_replica(replica(PS, 0, port=port))
    wait_for(c, seen, phase_is("ps-0", Phase.RUNNING), 30)
    started = time.monotonic()
    c.close()  # on servers up to 1.22 the Service DELETE answers a Status: must not raise
    assert time.monotonic() - started < 5
    assert server.list("services") == []
    # the pod may stay Terminating until the kubelet confirms: wait, do not assume
    wait_until(lambda: not server.list("pods") and not kubelet.running(), 30,
               "the closed job's pods to go")


def test_fraction_priority_keeps_share_of_high_workers(server, kubelet):
    cl = create(job(worker_pod_priority="0.5", num_workers=4, namespace=server.namespace),
                server.kubeconfig, watch_timeout_s=5)

    def classes() -> dict[str, str]:
        return {p["metadata"]["name"][-8:]: p["spec"].get("priorityClassName", "")
                for p in server.list("pods")}

    try:
        seen: list[ReplicaEvent] = []
        for i in range(4):
            cl.create_replica(replica(W, i))
        assert sorted(classes().values()) == ["high", "high", "low", "low"]
        high = next(n for n, c in classes().items() if c == "high")
        wait_for(cl, seen, phase_is(high, Phase.RUNNING), 30)
        kubelet.kill(server.namespace, f"elasticdl-t1-{high}")
        wait_for(cl, seen, phase_is(high, Phase.FAILED), 30)
        cl.create_replica(replica(W, 4))  # replaces a high worker: gets high
        assert classes()["worker-4"] == "high"
    finally:
        cl.close()


def test_no_kubeconfig_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(KubeConfigError, match="no Kubernetes configuration.*missing"):
        KubernetesCluster.from_job_spec(job(), str(tmp_path))


def test_forbidden_is_a_clear_error(server):
    if server.real:
        if not server.plane.own:
            pytest.skip("the user's own kubeconfig may have rights everywhere")
        namespace = "kube-system"  # RBAC: `user` has no rights there
    else:
        server.fake.forbidden = True
        namespace = server.namespace
    with pytest.raises(PermissionDenied, match="permission denied.*elasticdl rbac"):
        create(job(namespace=namespace), server.kubeconfig)


def test_from_job_spec_in_the_master_pod(server, kubelet, monkeypatch, port_base):
    from kubernetes import client

    from elasticdl.cluster.k8s_api import load_api_client

    api = load_api_client(server.kubeconfig)
    master = client.CoreV1Api(api).create_namespaced_pod(server.namespace, client.V1Pod.from_dict({
        "metadata": {"name": "elasticdl-t1-master"},
        "spec": {"containers": [{"name": "m", "image": "img", "command": list(SLEEP)}]}}))
    api.close()
    for k, v in {"KUBECONFIG": server.kubeconfig, "MY_POD_NAME": "elasticdl-t1-master",
                 "MY_POD_IP": "10.1.2.3", "ELASTICDL_K8S_PORT_BASE": str(port_base),
                 "ELASTICDL_K8S_SERVICE_HOST": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    c = KubernetesCluster.from_job_spec(job(namespace=server.namespace), "/unused")
    try:
        assert c.master_address() == f"10.1.2.3:{port_base}"
        assert c.endpoint(PS, 1) == (port_base + 2, f"127.0.0.1:{port_base + 2}")
        c.create_replica(replica(W, 0))
        pod = server.get("pods", pod_name("t1", W, 0))
        assert pod is not None
        assert pod["metadata"]["ownerReferences"][0]["uid"] == master.metadata.uid
    finally:
        c.close()
    assert sys.executable  # the kubelet maps "python" to this interpreter
