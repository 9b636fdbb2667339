"""Only a genuine API server shows these (``k8s_real``; see tests/k8s/realcluster.py).

* server-side dry run (``dryRun=All``: defaulting, validation and admission, no
  object stored) of every manifest the project can produce (``--data_secret``: what
  the server keeps holds the Secret by reference, no credential value);
* a GPU request without a limit (the documented ``gpu=1``) is accepted and runs;
* 410 Gone on a watch, forced: the pod watch cache is off (``WATCH_CACHE_OFF=1``)
  and etcd's history is compacted while the cluster cannot watch.
"""

from __future__ import annotations

import json
import logging

import pytest

from elasticdl.cluster import k8s_access as access
from elasticdl.cluster.api import Phase, ReplicaEvent, ReplicaType
from elasticdl.cluster.kubernetes import create
from elasticdl.cluster.manifests import pod_name
from tests.k8s.test_kubernetes_cluster import job, phase_is, replica, wait_for, wait_until
from tests.k8s.test_manifests import VARIANTS, all_manifests, spec

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real]
W = ReplicaType.WORKER


@pytest.fixture
def user_core(server):
    from kubernetes import client

    from elasticdl.cluster.k8s_api import load_api_client

    api = load_api_client(server.kubeconfig)
    yield client.CoreV1Api(api)
    api.close()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_manifest_passes_server_side_dry_run(server, user_core, variant):
    """As `user` (only the Role of `elasticdl rbac`): pods and Services; as admin: RBAC."""
    from kubernetes import client, utils

    from tests.k8s.realcluster import ensure_priority_classes

    job_spec = spec(namespace=server.namespace, **VARIANTS[variant])
    ensure_priority_classes(server.admin, ("spot-low",))  # the class_priority variant
    batch = client.BatchV1Api(user_core.api_client)
    for obj in all_manifests(job_spec):
        create = {"Pod": user_core.create_namespaced_pod,
                  "Service": user_core.create_namespaced_service,
                  "Job": batch.create_namespaced_job}[obj["kind"]]
        resp = create(server.namespace, obj, dry_run="All", _preload_content=False)
        made = json.loads(resp.data)
        assert made["metadata"]["name"] == obj["metadata"]["name"]
        if obj["kind"] in ("Pod", "Job"):  # defaulted by the server, what we asked kept
            pod_spec = made["spec"]["template"]["spec"] if obj["kind"] == "Job" \
                else made["spec"]
            asked = obj["spec"]["template"]["spec"] if obj["kind"] == "Job" else obj["spec"]
            container = pod_spec["containers"][0]
            assert pod_spec["schedulerName"] == "default-scheduler"
            assert container["command"] == asked["containers"][0]["command"]
            if job_spec.data_secret:   # credentials by reference only, kept by the server
                assert container["envFrom"] == [{"secretRef": {"name": job_spec.data_secret}}]
                assert not any(e["name"].startswith("AWS_") for e in container.get("env", []))
                assert "s3-credentials" not in json.dumps(made["metadata"])
            requests = container.get("resources", {}).get("requests", {})
            if "nvidia.com/gpu" in requests:
                assert container["resources"]["limits"]["nvidia.com/gpu"] == \
                    requests["nvidia.com/gpu"]
    assert server.list("pods") == [] and server.list("services") == []  # nothing stored
    assert server.list("jobs") == []
    for doc in access.rbac_manifests(server.namespace):
        doc["metadata"]["name"] = "dry-" + doc["metadata"]["name"]
        if doc["kind"] == "RoleBinding":
            doc["roleRef"]["name"] = "dry-elasticdl"
        utils.create_from_dict(server.admin, doc, namespace=server.namespace, dry_run="All")


def test_gpu_request_without_limit_runs(server, kubelet):
    """The documented `--worker_resource_request=cpu=2,memory=4096Mi,gpu=1` (no limit)."""
    c = create(job(namespace=server.namespace, worker_resource_request="cpu=1,memory=1Gi,gpu=1"),
               server.kubeconfig, watch_timeout_s=5)
    try:
        seen: list[ReplicaEvent] = []
        c.create_replica(replica(W, 0, ("python", "-c", "pass")))
        assert wait_for(c, seen, phase_is("worker-0", Phase.SUCCEEDED)).reason == "completed"
        pod = server.get("pods", pod_name("t1", W, 0))
        assert pod is not None and pod["spec"]["nodeName"] == "fake-node"
        resources = pod["spec"]["containers"][0]["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == "1"
        assert resources["requests"]["nvidia.com/gpu"] == "1"
    finally:
        c.close()


def test_watch_relists_after_410_gone(server, kubelet, caplog):
    """The cluster loses its watch (RBAC revoked), meanwhile worker-0 dies and worker-1 is
    deleted and etcd compacts that history; once allowed again the watch gets 410 and the
    cluster lists and reconciles: both endings arrive."""
    from kubernetes import client

    if not server.plane.own:
        pytest.skip("needs the control plane's etcd (compaction) and `user`'s RoleBinding")
    caplog.set_level(logging.INFO, logger="elasticdl.cluster")
    ns = server.namespace
    rbac = client.RbacAuthorizationV1Api(server.admin)
    core = client.CoreV1Api(server.admin)
    c = create(job(namespace=ns), server.kubeconfig, watch_timeout_s=2)
    try:
        seen: list[ReplicaEvent] = []
        c.create_replica(replica(W, 0))
        c.create_replica(replica(W, 1))
        wait_for(c, seen, phase_is("worker-0", Phase.RUNNING))
        wait_for(c, seen, phase_is("worker-1", Phase.RUNNING))
        binding = rbac.read_namespaced_role_binding("elasticdl-user", ns)
        rbac.delete_namespaced_role_binding("elasticdl-user", ns)

        def refused() -> bool:
            return any("pod watch interrupted (HTTP 403" in r.getMessage()
                       for r in caplog.records)

        wait_until(refused, 30, "the cluster's watch to be refused")
        kubelet.kill(ns, pod_name("t1", W, 0))
        core.delete_namespaced_pod(pod_name("t1", W, 1), ns, grace_period_seconds=0)
        wait_until(lambda: server.phase(pod_name("t1", W, 0)) == "Failed"
                   and server.get("pods", pod_name("t1", W, 1)) is None, 30,
                   "worker-0 to fail and worker-1 to go")
        early = c.poll_events(0.5)  # refused meanwhile: the watch saw neither ending
        assert not [e for e in early if e.phase in (Phase.FAILED, Phase.DELETED)], early
        seen.extend(early)
        rv = json.loads(core.list_namespaced_pod(ns, _preload_content=False).data)[
            "metadata"]["resourceVersion"]
        server.plane.compact_etcd(int(rv))
        binding.metadata.resource_version = None
        rbac.create_namespaced_role_binding(ns, binding)
        assert wait_for(c, seen, phase_is("worker-0", Phase.FAILED)).reason == "killed"
        assert wait_for(c, seen, phase_is("worker-1", Phase.DELETED)).reason == "deleted"
        assert any("watch expired at resourceVersion" in r.getMessage()
                   for r in caplog.records), "no 410 Gone: the cluster never listed again"
    finally:
        c.close()
