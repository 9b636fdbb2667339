"""Every manifest the code can produce passes the upstream Kubernetes schemas.

``kubernetes_validate`` checks structure (strict: no unknown fields) against
the OpenAPI schemas of a recent and an older Kubernetes; names and label
values, which the schemas do not check, are checked here against the API
server's rules.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest

from elasticdl.cluster import k8s_access as access
from elasticdl.cluster import k8s_master as km
from elasticdl.cluster import manifests as mf
from elasticdl.cluster.api import ReplicaSpec, ReplicaType
from elasticdl.common.job_spec import JobSpec

kubernetes_validate = pytest.importorskip("kubernetes_validate")
pytestmark = pytest.mark.k8s

VERSIONS = ("1.37.0", "1.28.0")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
OWNER = mf.owner_reference("elasticdl-j-master", "5f0c8a52-1d7e-4bb3-9a4c-2f2c0b8f8d11")
JOB_OWNER = mf.owner_reference("elasticdl-j-master", "6a1d9b63-2e8f-4cc4-8b5d-3a3d1c9f9e22",
                               "Job")

CLUSTER_SPEC = {
    "metadata": {"annotations": {"sidecar.istio.io/inject": "false"},
                 "labels": {"team": "ml"}},
    "spec": {
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                         "effect": "NoSchedule"}],
        "nodeSelector": {"pool": "training"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["a", "b"]}]}]}}},
        "containers": [{"name": "elasticdl", "securityContext": {"runAsNonRoot": True}}],
    },
}


def spec(**kw: Any) -> JobSpec:
    base: dict[str, Any] = dict(model_zoo="model_zoo", model_def="digits.digits_cnn.custom_model",
                                training_data="/data/train", image_name="reg/digits:v1",
                                job_name="digits-1",
                                distribution_strategy="ParameterServerStrategy")
    base.update(kw)
    if {"max_master_restarts", "master_state_pvc"} & set(kw):
        return failover_spec_class()(**base)
    return JobSpec(**base)


def failover_spec_class() -> Any:
    """JobSpec, extended by the master failover fields (``max_master_restarts``,
    ``master_state_pvc``) while JobSpec does not have them yet (another branch adds
    them; ``manifests`` reads them with getattr)."""
    known = {f.name for f in dataclasses.fields(JobSpec)}
    extra = [(n, t, dataclasses.field(default=d)) for n, t, d in
             (("max_master_restarts", int, 3), ("master_state_pvc", str, ""))
             if n not in known]
    if not extra:
        return JobSpec
    return dataclasses.make_dataclass("FailoverJobSpec", extra, bases=(JobSpec,), frozen=True)


VARIANTS = {
    "defaults": {},
    "gpu_request_only": dict(worker_resource_request="cpu=2,memory=4096Mi,gpu=1"),
    "gpus": dict(worker_resource_request="cpu=2,memory=4096Mi,gpu=1",
                 worker_resource_limit="cpu=4,memory=8Gi,gpu=1,ephemeral-storage=10Gi",
                 master_resource_limit="cpu=1,memory=2Gi"),
    "volumes_envs": dict(volume="host_path=/mnt/data,mount_path=/data,type=Directory;"
                                "claim_name=ckpt,mount_path=/ckpt,sub_path=job1",
                         envs="A=1,LOG_LEVEL=debug", image_pull_policy="IfNotPresent"),
    "priorities": dict(master_pod_priority="high", ps_pod_priority="high",
                       worker_pod_priority="0.5"),
    "class_priority": dict(worker_pod_priority="spot-low"),
    "cluster_spec": dict(cluster_spec=json.dumps(CLUSTER_SPEC)),
    "long_name": dict(job_name="a" * 52),
    "digit_name": dict(job_name="7-digits"),
    "master_state_pvc": dict(master_state_pvc="edl-state", max_master_restarts=5),
    # object storage: credentials by reference to a Secret, the endpoint in the spec
    "data_secret": dict(training_data="s3://digits/train", data_secret="s3-credentials",
                        data_endpoint="http://minio.storage:9000"),
}


def validate(obj: dict[str, Any]) -> None:
    for version in VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)
    meta = obj["metadata"]
    name_rule = DNS1035_LABEL if obj["kind"] == "Service" else DNS1123_SUBDOMAIN
    assert name_rule.match(meta["name"]), meta["name"]
    if obj["kind"] == "Job":  # the Job controller puts its name in a label of its pods
        assert LABEL_VALUE.match(meta["name"]) and len(meta["name"]) <= 63, meta["name"]
    for key, value in (meta.get("labels") or {}).items():
        assert LABEL_VALUE.match(value), (key, value)
    json.dumps(obj)  # plain data only


def all_manifests(job: JobSpec) -> list[dict[str, Any]]:
    """Every shape client and cluster create for ``job`` (one of each)."""
    out = [km.master_pod(job, base=42000), access.master_job(job, 42000),
           km.master_service(job, 42000, JOB_OWNER)]
    for type, index, port in ((ReplicaType.PS, 11, 50013), (ReplicaType.WORKER, 123, 0)):
        rs = ReplicaSpec(job.job_name, type, index,
                         ("python", "-m", f"elasticdl.{type.value}.main", f"--id={index}"),
                         env={"ELASTICDL_X": "1"}, port=port)
        priority = getattr(job, f"{type.value}_pod_priority")
        out.append(mf.replica_pod(job, rs, mf.resolve_priority(priority, type, True), OWNER))
        if mf.parse_fraction(priority) is not None:
            out.append(mf.replica_pod(job, rs, mf.resolve_priority(priority, type, False)))
    out.append(mf.ps_service(job, 11, 50013, OWNER))
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_manifest_validates(variant):
    for obj in all_manifests(spec(**VARIANTS[variant])):
        validate(obj)


@pytest.mark.parametrize("namespace", ["default", "ml-team"])
def test_rbac_validates_and_is_minimal(namespace):
    docs = access.rbac_manifests(namespace)
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding"]
    for doc in docs:
        validate(doc)
        assert doc["metadata"]["namespace"] == namespace
    rules = {r["resources"][0]: set(r["verbs"]) for r in docs[1]["rules"]}
    assert rules == {"pods": {"create", "delete", "get", "list", "watch",
                              "patch"},  # `elasticdl scale`'s annotation on the master pod
                     "events": {"list"},  # was a deleted replica preempted?
                     "services/proxy": {"get"},  # `elasticdl status` reads /metrics
                     "pods/log": {"get"}, "services": {"create", "delete"},
                     "secrets": {"create", "delete"},  # the job token's Secret; no read
                     "jobs": {"create", "delete", "get"}}  # the client's master Job
    assert docs[2]["subjects"][0]["namespace"] == namespace
    assert "namespace: " + namespace in access.rbac_yaml(namespace)


def test_master_pod_carries_the_job_spec(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(CLUSTER_SPEC))
    job = spec(cluster_spec=str(path), yaml="out.yaml", cluster="")
    pod = km.master_pod(job)
    command = pod["spec"]["containers"][0]["command"]
    assert command[:3] == ["python", "-m", "elasticdl.master.main"]
    assert command[-1] == "--port=50001"
    carried = JobSpec.from_json(command[3].split("=", 1)[1])
    assert carried.cluster == "k8s" and carried.yaml == ""
    assert json.loads(carried.cluster_spec) == CLUSTER_SPEC  # a laptop path is inlined
    assert pod["spec"]["serviceAccountName"] == "elasticdl"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
    assert pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    container = pod["spec"]["containers"][0]
    assert container["securityContext"] == {"runAsNonRoot": True}
    assert container["image"] == "reg/digits:v1"


def test_replica_pod_details():
    job = spec(**VARIANTS["volumes_envs"], worker_resource_request="cpu=2,gpu=1")
    rs = ReplicaSpec("digits-1", ReplicaType.WORKER, 3, ("python", "-c", "pass"),
                     env={"A": "override"})
    pod = mf.replica_pod(job, rs, "high", OWNER)
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["MY_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["MY_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["A"] == "override" and env["LOG_LEVEL"] == "debug"
    assert c["resources"]["requests"] == {"cpu": "2", "nvidia.com/gpu": "1"}
    assert c["imagePullPolicy"] == "IfNotPresent"
    assert [m["mountPath"] for m in c["volumeMounts"]] == ["/data", "/ckpt"]
    assert pod["spec"]["volumes"][1]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    assert pod["spec"]["priorityClassName"] == "high"
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["metadata"]["ownerReferences"] == [OWNER]
    assert pod["metadata"]["labels"] == {
        "app": "elasticdl", "elasticdl-job-name": "digits-1",
        "elasticdl-replica-type": "worker", "elasticdl-replica-index": "3"}


def test_extended_resources_are_limited_at_their_request():
    job = spec(worker_resource_request="cpu=2,memory=4096Mi,gpu=1,amd.com/gpu=2",
               worker_resource_limit="cpu=4")
    rs = ReplicaSpec("digits-1", ReplicaType.WORKER, 0, ("python", "-c", "pass"))
    res = mf.replica_pod(job, rs)["spec"]["containers"][0]["resources"]
    assert res["requests"] == {"cpu": "2", "memory": "4096Mi", "nvidia.com/gpu": "1",
                               "amd.com/gpu": "2"}
    assert res["limits"] == {"cpu": "4", "nvidia.com/gpu": "1", "amd.com/gpu": "2"}
    assert mf.overcommittable("ephemeral-storage") and mf.overcommittable("kubernetes.io/x")
    assert not mf.overcommittable("hugepages-2Mi")
    with pytest.raises(ValueError, match="nvidia.com/gpu: request 1 and limit 2 must be equal"):
        mf.replica_pod(spec(worker_resource_request="gpu=1", worker_resource_limit="gpu=2"),
                       rs)


def test_names_and_ports():
    assert mf.pod_name("j", ReplicaType.MASTER) == "elasticdl-j-master"
    assert mf.pod_name("j", ReplicaType.WORKER, 4) == "elasticdl-j-worker-4"
    assert mf.ps_service_name("j", 2) == "j-ps-2"
    assert mf.ps_service_name("7j", 2) == "edl-7j-ps-2"
    assert [mf.replica_port(50001, t, 2) for t in ReplicaType] == [50001, 50004, 51004]
    assert mf.port_base({}) == 50001 and mf.port_base({mf.PORT_BASE_ENV: "42000"}) == 42000
    with pytest.raises(ValueError):
        mf.port_base({mf.PORT_BASE_ENV: "80"})


def test_cluster_spec_errors_are_clear(tmp_path):
    for text, match in (("{not json", "not valid JSON"), ("[1]", "JSON object"),
                        ('{"pod": {}}', "unknown top-level"),
                        ('{"metadata": {"name": "x"}}', "labels and annotations"),
                        (str(tmp_path / "nope.json"), "neither inline JSON nor a file")):
        with pytest.raises(ValueError, match=match):
            mf.load_cluster_spec(text)


def test_deep_merge_by_name_and_replace():
    base = {"a": {"b": 1, "c": [1, 2]}, "containers": [{"name": "x", "image": "i"}]}
    patch = {"a": {"c": [3]}, "containers": [{"name": "x", "tty": True},
                                             {"name": "sidecar", "image": "s"}]}
    assert mf.deep_merge(base, patch) == {
        "a": {"b": 1, "c": [3]},
        "containers": [{"name": "x", "image": "i", "tty": True},
                       {"name": "sidecar", "image": "s"}]}
    assert base["containers"] == [{"name": "x", "image": "i"}]  # inputs untouched


def test_priorities():
    W, PS = ReplicaType.WORKER, ReplicaType.PS
    assert mf.resolve_priority("", W) == ""
    assert mf.resolve_priority("high", PS) == "high"
    assert mf.resolve_priority("spot", W) == "spot"
    assert mf.resolve_priority("0.5", W, high=True) == "high"
    assert mf.resolve_priority("0.5", W, high=False) == "low"
    with pytest.raises(ValueError, match="only applies to workers"):
        mf.resolve_priority("0.5", PS)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        mf.parse_fraction("1.5")


def test_yaml_round_trip():
    import yaml

    objs = [km.master_pod(spec())] + access.rbac_manifests()
    assert list(yaml.safe_load_all(mf.to_yaml(objs))) == objs


def test_job_secret_and_the_pods_reading_it():
    from elasticdl.common import auth

    job = spec()
    secrets = auth.JobSecrets("k" * 43, b"CERT", b"KEY")
    owner = mf.owner_reference("elasticdl-j-master", "uid-1")
    secret = access.job_secret(job, secrets.data(), owner)
    validate(secret)
    assert secret["metadata"]["ownerReferences"] == [owner]
    assert sorted(secret["data"]) == ["tls.crt", "tls.key", "token"]
    pod = mf.replica_pod(job, ReplicaSpec(job.job_name, ReplicaType.WORKER, 0,
                                          ("python", "-m", "x"),
                                          env={auth.TOKEN_ENV: "plain, from --envs"}))
    access.with_secret_env(pod, job.job_name, sorted(secret["data"]))
    validate(pod)
    env = pod["spec"]["containers"][0]["env"]
    token_env = [e for e in env if e["name"] == auth.TOKEN_ENV]
    assert token_env == [{"name": auth.TOKEN_ENV, "valueFrom": {"secretKeyRef": {
        "name": access.job_secret_name(job.job_name), "key": "token"}}}]
    assert {e["name"] for e in env} >= {auth.TLS_CERT_ENV, auth.TLS_KEY_ENV}
    assert "k" * 43 not in json.dumps(pod)


def test_master_job_restarts_the_master_and_keeps_its_state():
    job = spec(master_state_pvc="edl-state", max_master_restarts=5)
    master = access.master_job(job, 42000)
    assert master["kind"] == "Job" and master["spec"]["backoffLimit"] == 5
    pod = master["spec"]["template"]
    assert pod["metadata"]["labels"]["elasticdl-replica-type"] == "master"
    assert pod["spec"]["restartPolicy"] == "Never"
    container = pod["spec"]["containers"][0]
    # the master's job directory (journal, secrets) lives on the claim
    assert container["command"][-2:] == ["--restore", f"--job_dir={km.MASTER_STATE_DIR}"]
    mount = [m for m in container["volumeMounts"] if m["name"] == km.MASTER_STATE_VOLUME]
    # one directory per Job (its uid): a later job of the same name does not restore it
    assert mount == [{"name": km.MASTER_STATE_VOLUME, "mountPath": km.MASTER_STATE_DIR,
                      "subPathExpr": f"digits-1-$({km.JOB_UID_ENV})"}]
    assert {"name": km.JOB_UID_ENV, "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['controller-uid']"}}} in container["env"]
    assert {"name": km.MASTER_STATE_VOLUME,
            "persistentVolumeClaim": {"claimName": "edl-state"}} in pod["spec"]["volumes"]
    # a restarted master reads the token its replicas hold from the job's Secret
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]
            if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs["ELASTICDL_JOB_TOKEN"] == {"name": "elasticdl-digits-1-token", "key": "token",
                                           "optional": True}
    # without a claim: no volume, the default job directory (lost with the pod)
    assert master["metadata"]["name"] == "elasticdl-digits-1-master"
    long_names = {mf.master_job_name("a" * 52 + s) for s in ("x", "y")}
    assert len(long_names) == 2 and all(len(n) <= 63 for n in long_names)
    plain = access.master_job(spec(), 42000)["spec"]["template"]["spec"]
    assert "volumes" not in plain
    assert not any(a.startswith("--job_dir") for a in plain["containers"][0]["command"])
    service = km.master_service(spec(job_name="7-digits"), 42000, JOB_OWNER)
    assert service["metadata"]["name"] == "edl-7-digits-master"
    assert service["spec"]["selector"] == mf.labels("7-digits", ReplicaType.MASTER, 0)
    assert service["metadata"]["ownerReferences"][0]["kind"] == "Job"
