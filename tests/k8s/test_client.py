"""The client (submit, --yaml, status, logs, stop, rbac) against the stand-in."""

from __future__ import annotations

import io
import json
import os
import threading
import time

import pytest
import yaml

from elasticdl.cluster import manifests as mf
from elasticdl.cluster.manifests import pod_name
from elasticdl.common.job_spec import JobSpec
from elasticdl_client import k8s

pytestmark = pytest.mark.k8s


def job(**kw: object) -> JobSpec:
    base = dict(model_zoo="zoo", model_def="m.f", training_data="d", image_name="img:1",
                job_name="c1", distribution_strategy="ParameterServerStrategy")
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def put_pod(apiserver, name: str, labels: dict[str, str], status: dict) -> None:
    code, _ = apiserver.create("pods", "default", {
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "i"}]}})
    assert code == 201
    apiserver.patch("pods", "default", name, {"status": status}, status_only=True)


def labels(type: str, index: int, job_name: str = "c1") -> dict[str, str]:
    return {"app": "elasticdl", "elasticdl-job-name": job_name,
            "elasticdl-replica-type": type, "elasticdl-replica-index": str(index)}


def wait_for(predicate, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s")


def test_submit_creates_the_master_job(kubeconfig, apiserver, capsys):
    out = io.StringIO()
    assert k8s.submit(job(), kubeconfig, out=out) == 0
    master_job = apiserver.get("jobs", "default", "elasticdl-c1-master")
    assert master_job["spec"]["backoffLimit"] == 3
    # the Job controller runs the master pod from the template
    pods = wait_for(lambda: apiserver.list("pods", "default", "elasticdl-replica-type=master"))
    pod = pods[0]
    assert pod["metadata"]["name"].startswith("elasticdl-c1-master-")
    assert pod["metadata"]["labels"]["elasticdl-replica-type"] == "master"
    command = pod["spec"]["containers"][0]["command"]
    assert JobSpec.from_json(command[3].split("=", 1)[1]).job_name == "c1"
    assert "elasticdl status c1" in out.getvalue()
    # the same job again: a clear refusal, exit 1
    assert k8s.submit(job(), kubeconfig, out=out) == 1
    assert "already exists" in capsys.readouterr().err


def test_yaml_writes_instead_of_submitting(kubeconfig, apiserver, tmp_path):
    path = tmp_path / "job.yaml"
    assert k8s.submit(job(yaml=str(path)), kubeconfig, out=io.StringIO()) == 0
    docs = list(yaml.safe_load_all(path.read_text()))
    assert [d["kind"] for d in docs] == ["Job"]
    assert docs[0]["metadata"]["name"] == "elasticdl-c1-master"
    assert apiserver.list("pods") == [] and apiserver.list("jobs") == []


def test_status_shows_replicas_and_progress(kubeconfig, apiserver):
    put_pod(apiserver, "elasticdl-c1-master", labels("master", 0), {"phase": "Running"})
    put_pod(apiserver, "elasticdl-c1-ps-0", labels("ps", 0), {"phase": "Running"})
    put_pod(apiserver, "elasticdl-c1-worker-1", labels("worker", 1), {
        "phase": "Failed", "containerStatuses": [{"name": "c", "state": {"terminated": {
            "exitCode": 137, "reason": "OOMKilled"}}}]})
    put_pod(apiserver, "elasticdl-c1-worker-0", labels("worker", 0), {"phase": "Running"})
    put_pod(apiserver, "elasticdl-other-master", labels("master", 0, "other"),
            {"phase": "Running"})
    os.makedirs(os.path.join(apiserver.log_dir, "default"))
    with open(os.path.join(apiserver.log_dir, "default", "elasticdl-c1-master.log"), "w") as f:
        f.write("".join(f"line {i}\n" for i in range(10)) + "training: 640/1437 rec (44.5%)\n")
    out = io.StringIO()
    assert k8s.status("c1", kubeconfig=kubeconfig, tail=2, out=out) == 0
    lines = out.getvalue().splitlines()
    table = [ln.split() for ln in lines[2:6]]
    assert table == [["master", "running"], ["ps-0", "running"], ["worker-0", "running"],
                     ["worker-1", "failed", "oom", "137"]]
    assert lines[-2:] == ["  line 9", "  training: 640/1437 rec (44.5%)"]
    assert k8s.status("nope", kubeconfig=kubeconfig, out=out) == 1


def test_logs_and_follow(kubeconfig, apiserver):
    put_pod(apiserver, pod_name("c1", k8s.ReplicaType.WORKER, 3), labels("worker", 3),
            {"phase": "Running"})
    path = os.path.join(apiserver.log_dir, "default", "elasticdl-c1-worker-3.log")
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write("first\n")
    out = io.StringIO()
    assert k8s.logs("c1", "worker-3", kubeconfig=kubeconfig, out=out) == 0
    assert out.getvalue() == "first\n"

    def finish() -> None:
        time.sleep(0.3)
        with open(path, "a") as f:
            f.write("second\n")
        time.sleep(0.2)
        apiserver.patch("pods", "default", "elasticdl-c1-worker-3",
                        {"status": {"phase": "Succeeded"}}, status_only=True)

    t = threading.Thread(target=finish)
    t.start()
    out = io.StringIO()
    started = time.monotonic()
    assert k8s.logs("c1", "worker-3", follow=True, kubeconfig=kubeconfig, out=out) == 0
    t.join(timeout=5)
    assert out.getvalue() == "first\nsecond\n" and time.monotonic() - started < 10
    assert k8s.logs("c1", "worker-9", kubeconfig=kubeconfig, out=out) == 1
    assert k8s.logs("c1", "chief", kubeconfig=kubeconfig, out=out) == 2


def test_stop_cascades_through_owner_references(kubeconfig, apiserver):
    assert k8s.submit(job(), kubeconfig, out=io.StringIO()) == 0
    master = apiserver.get("jobs", "default", "elasticdl-c1-master")
    wait_for(lambda: apiserver.list("pods", "default", "elasticdl-replica-type=master"))
    # what the master gives its replicas: not a controller reference (the Job controller
    # strips those from pods it did not make, which raced with this test's stop)
    owner = [mf.owner_reference("elasticdl-c1-master", master["metadata"]["uid"], "Job")]
    for name, kind in (("elasticdl-c1-worker-0", "pods"), ("c1-ps-0", "services")):
        apiserver.create(kind, "default", {"metadata": {"name": name,
                                                        "ownerReferences": owner}})
    assert k8s.stop("c1", kubeconfig=kubeconfig, out=io.StringIO()) == 0
    assert apiserver.list("pods") == [] and apiserver.list("services") == []
    assert apiserver.list("jobs") == []
    assert k8s.stop("c1", kubeconfig=kubeconfig, out=io.StringIO()) == 1


def test_stop_deletes_a_bare_master_pod_of_an_older_job(kubeconfig, apiserver):
    put_pod(apiserver, "elasticdl-c1-master", labels("master", 0), {"phase": "Running"})
    assert k8s.submit(job(), kubeconfig, out=io.StringIO()) == 1  # the job exists
    assert k8s.stop("c1", kubeconfig=kubeconfig, out=io.StringIO()) == 0
    assert apiserver.list("pods") == []


def test_no_kubeconfig_and_forbidden_exit_2(tmp_path, monkeypatch, kubeconfig, apiserver,
                                            capsys):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.setenv("HOME", str(tmp_path))
    for call in (lambda: k8s.submit(job()), lambda: k8s.status("c1"),
                 lambda: k8s.logs("c1"), lambda: k8s.stop("c1")):
        assert call() == 2
        assert "no Kubernetes configuration" in capsys.readouterr().err
    apiserver.forbidden = True
    for call in (lambda: k8s.submit(job(), kubeconfig), lambda: k8s.status("c1", "default", 5,
                                                                           kubeconfig),
                 lambda: k8s.logs("c1", kubeconfig=kubeconfig),
                 lambda: k8s.stop("c1", kubeconfig=kubeconfig)):
        assert call() == 2
        err = capsys.readouterr().err
        assert "permission denied" in err and "elasticdl rbac" in err, err


def test_rbac_prints_namespaced_manifests():
    out = io.StringIO()
    assert k8s.rbac("ml", out=out) == 0
    docs = list(yaml.safe_load_all(out.getvalue()))
    assert {d["metadata"]["namespace"] for d in docs} == {"ml"}
    assert json.dumps(docs)
