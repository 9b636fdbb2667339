"""KubernetesCluster against the stand-in API server and test kubelet.

Each test runs real processes as "pods" and checks the ReplicaEvents the
master would see: exit codes and reasons, deletion, watch resumption after a
dropped connection and after 410 Gone, owner-reference cascade, clear errors.
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
             pred: Callable[[ReplicaEvent], bool], timeout_s: float = 15.0) -> ReplicaEvent:
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


@pytest.fixture
def cluster(kubeconfig, kubelet) -> Iterator[KubernetesCluster]:
    c = create(job(), kubeconfig, watch_timeout_s=5)
    yield c
    c.close()


def test_exit_codes_become_reasons(cluster, kubelet):
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


def test_kill9_oom_and_eviction(cluster, kubelet):
    seen: list[ReplicaEvent] = []
    for i in range(3):
        cluster.create_replica(replica(W, i))
    for i in range(3):
        wait_for(cluster, seen, phase_is(f"worker-{i}", Phase.RUNNING))
    kubelet.kill("default", pod_name("t1", W, 0), signal.SIGKILL)
    kubelet.oom_kill("default", pod_name("t1", W, 1))
    kubelet.evict("default", pod_name("t1", W, 2))
    got = {i: wait_for(cluster, seen, phase_is(f"worker-{i}", Phase.FAILED)) for i in range(3)}
    assert (got[0].reason, got[0].exit_code) == ("killed", 137)
    assert (got[1].reason, got[1].exit_code) == ("oom", 137)
    assert got[2].reason == "killed" and "low on resource" in got[2].message


def test_deletion_by_someone_else_and_by_the_master(cluster, kubelet, api_client):
    from kubernetes import client

    seen: list[ReplicaEvent] = []
    cluster.create_replica(replica(W, 0))
    cluster.create_replica(replica(W, 1))
    wait_for(cluster, seen, phase_is("worker-1", Phase.RUNNING))
    wait_for(cluster, seen, phase_is("worker-0", Phase.RUNNING))
    pid = kubelet.pid("default", pod_name("t1", W, 0))
    client.CoreV1Api(api_client).delete_namespaced_pod(pod_name("t1", W, 0), "default")
    e = wait_for(cluster, seen, phase_is("worker-0", Phase.DELETED))
    assert e.reason == "deleted"
    cluster.delete_replica(W, 1)
    assert wait_for(cluster, seen, phase_is("worker-1", Phase.DELETED)).reason == "deleted"
    deadline = time.monotonic() + 10
    while kubelet.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kubelet.running() == [], f"process {pid} of the deleted pod still runs"
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


def test_ps_service_owner_refs_and_cascade(kubeconfig, kubelet, apiserver, api_client):
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    master = core.create_namespaced_pod("default", client.V1Pod.from_dict({
        "metadata": {"name": pod_name("t1", ReplicaType.MASTER), "labels": {"app": "x"}},
        "spec": {"containers": [{"name": "m", "image": "img", "command": list(SLEEP)}]}}))
    c = KubernetesCluster(job(), api_client, owner=(master.metadata.name, master.metadata.uid),
                          watch_timeout_s=5)
    try:
        seen: list[ReplicaEvent] = []
        port, address = c.endpoint(PS, 0)
        assert address == f"t1-ps-0.default.svc:{port}"
        c.create_replica(replica(PS, 0, port=port))
        c.create_replica(replica(W, 0))
        wait_for(c, seen, phase_is("ps-0", Phase.RUNNING))
        wait_for(c, seen, phase_is("worker-0", Phase.RUNNING))
        svc = apiserver.get("services", "default", "t1-ps-0")
        assert svc["spec"]["ports"][0]["port"] == port
        assert svc["spec"]["selector"]["elasticdl-replica-index"] == "0"
        for obj in (svc, apiserver.get("pods", "default", pod_name("t1", W, 0))):
            assert obj["metadata"]["ownerReferences"][0]["uid"] == master.metadata.uid
        # a failed PS is relaunched under the same name (and keeps its Service)
        kubelet.kill("default", pod_name("t1", PS, 0))
        wait_for(c, seen, phase_is("ps-0", Phase.FAILED))
        c.create_replica(replica(PS, 0, port=port))
        wait_for(c, [], phase_is("ps-0", Phase.RUNNING))
        core.delete_namespaced_pod(master.metadata.name, "default")
        deadline = time.monotonic() + 10
        while (apiserver.list("pods") or kubelet.running()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert apiserver.list("pods") == [] and apiserver.list("services") == []
        assert kubelet.running() == []
    finally:
        c.close()


def test_close_deletes_live_replicas(kubeconfig, kubelet, apiserver):
    c = create(job(), kubeconfig, watch_timeout_s=5)
    seen: list[ReplicaEvent] = []
    port, _ = c.endpoint(PS, 0)
    c.create_replica(replica(PS, 0, port=port))
    wait_for(c, seen, phase_is("ps-0", Phase.RUNNING))
    started = time.monotonic()
    c.close()
    assert time.monotonic() - started < 5
    assert apiserver.list("pods") == [] and apiserver.list("services") == []


def test_fraction_priority_keeps_share_of_high_workers(kubeconfig, kubelet, apiserver):
    cl = create(job(worker_pod_priority="0.5", num_workers=4), kubeconfig, watch_timeout_s=5)

    def classes() -> dict[str, str]:
        return {p["metadata"]["name"][-8:]: p["spec"].get("priorityClassName", "")
                for p in apiserver.list("pods")}

    try:
        seen: list[ReplicaEvent] = []
        for i in range(4):
            cl.create_replica(replica(W, i))
        assert sorted(classes().values()) == ["high", "high", "low", "low"]
        high = next(n for n, c in classes().items() if c == "high")
        kubelet.kill("default", f"elasticdl-t1-{high}")
        wait_for(cl, seen, phase_is(high, Phase.FAILED))
        cl.create_replica(replica(W, 4))  # replaces a high worker: gets high
        assert classes()["worker-4"] == "high"
    finally:
        cl.close()


def test_no_kubeconfig_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(KubeConfigError, match="no Kubernetes configuration.*missing"):
        KubernetesCluster.from_job_spec(job(), str(tmp_path))


def test_forbidden_is_a_clear_error(kubeconfig, apiserver):
    apiserver.forbidden = True
    with pytest.raises(PermissionDenied, match="permission denied.*elasticdl rbac"):
        create(job(), kubeconfig)


def test_from_job_spec_in_the_master_pod(kubeconfig, kubelet, apiserver, monkeypatch,
                                         port_base):
    from kubernetes import client

    from elasticdl.cluster.k8s_api import load_api_client

    api = load_api_client(kubeconfig)
    master = client.CoreV1Api(api).create_namespaced_pod("default", client.V1Pod.from_dict({
        "metadata": {"name": "elasticdl-t1-master"},
        "spec": {"containers": [{"name": "m", "image": "img", "command": list(SLEEP)}]}}))
    api.close()
    for k, v in {"KUBECONFIG": kubeconfig, "MY_POD_NAME": "elasticdl-t1-master",
                 "MY_POD_IP": "10.1.2.3", "ELASTICDL_K8S_PORT_BASE": str(port_base),
                 "ELASTICDL_K8S_SERVICE_HOST": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    c = KubernetesCluster.from_job_spec(job(), "/unused")
    try:
        assert c.master_address() == f"10.1.2.3:{port_base}"
        assert c.endpoint(PS, 1) == (port_base + 2, f"127.0.0.1:{port_base + 2}")
        c.create_replica(replica(W, 0))
        pod = apiserver.get("pods", "default", pod_name("t1", W, 0))
        assert pod["metadata"]["ownerReferences"][0]["uid"] == master.metadata.uid
    finally:
        c.close()
    assert sys.executable  # the kubelet maps "python" to this interpreter
