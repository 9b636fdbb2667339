"""End to end: `elasticdl train --image_name=...` -> master pod -> PS and worker pods
-> replicas deleted mid-run -> relaunch -> success; `status`, `logs`, `stop`.

Everything real except images and the container runtime: the CLI submits
through the official client, the test kubelet runs the master pod's `python
-m elasticdl.master.main`, which creates PS/worker pods through
KubernetesCluster, and the kubelet runs those too. Each test runs on the
stand-in and (``k8s_real``) on a genuine control plane, where the scheduler
binds the pods, the garbage collector cascades, and every call of the CLI, the
master and the pods is made as `user`, who holds only the Role of `elasticdl
rbac`. What this cannot show (images, pod networking and DNS, GPUs) is listed
in docs/kubernetes.md.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import time
from typing import Any, Optional

import pytest

from elasticdl.checkpoint.paths import complete_versions
from tests.conftest import MODEL_ZOO, ROOT

NEEDED = ("elasticdl.master.main", "elasticdl.ps.main", "elasticdl.worker.main")
MISSING = [m for m in NEEDED if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)} not importable yet: the "
                       "end-to-end Kubernetes job needs the master and the PS strategy"),
]


def wait_for(predicate: Any, timeout_s: float, what: str, diagnose: Any = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}"
                         + (f"\n{diagnose()}" if diagnose else ""))


def read_report(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def records_done(path: str) -> int:
    return sum(e.get("records_completed", 0) for e in (read_report(path) or {}).get("epochs", []))


def submit(server: Any, port_base: int, data: str, tmp_path: Any, job: str,
           *flags: str, train: str = "", val: str = "") -> None:
    env = dict(os.environ, KUBECONFIG=server.kubeconfig, ELASTICDL_K8S_PORT_BASE=str(port_base),
               ELASTICDL_HOME=str(tmp_path / "home"), PYTHONPATH=ROOT)
    cli = subprocess.run(
        [sys.executable, "-m", "elasticdl_client.main", "train",
         "--image_name=registry.local/digits:v1", "--image_pull_policy=IfNotPresent",
         f"--model_zoo={MODEL_ZOO}", "--model_def=digits.digits_cnn.custom_model",
         f"--training_data={train or data + '/train'}",
         f"--validation_data={val or data + '/val'}",
         f"--output={tmp_path / 'out'}", f"--job_name={job}",
         f"--namespace={server.namespace}", *flags],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "submitted job" in cli.stdout


def finished_report(server: Any, master: str, report_path: str,
                    timeout_s: float = 300) -> dict[str, Any]:
    """Waits for the job of ``master`` (its pod) to end; its ``succeeded`` report."""
    wait_for(lambda: server.phase(master) in ("Succeeded", "Failed"), timeout_s,
             "the job to finish", lambda: pod_log(server, master)[-6000:])
    assert server.phase(master) == "Succeeded", pod_log(server, master)[-6000:]
    report = read_report(report_path)
    assert report is not None and report["status"] == "succeeded", report
    return report


def pod_log(server: Any, name: str) -> str:
    path = os.path.join(server.log_dir, server.namespace, f"{name}.log")
    return open(path).read() if os.path.exists(path) else f"(no log of {name})"


def service_creates(server: Any) -> Optional[list[int]]:
    """HTTP codes of the Service creations (0: the stand-in logs no codes); from the
    stand-in's request log, or the real server's audit log (None: a user's cluster)."""
    if server.real and not server.plane.own:
        return None
    if server.fake is not None:
        return [0 for m, p in server.fake.requests if m == "POST" and p.endswith("/services")]
    with open(os.path.join(server.plane.dir, "logs", "audit.log")) as f:
        events = [json.loads(line) for line in f if '"services"' in line]
    return [e["responseStatus"]["code"] for e in events
            if e["verb"] == "create" and e["stage"] == "ResponseComplete"
            and e["objectRef"].get("namespace") == server.namespace
            and e["user"]["username"] == "user"]


def master_pod(server: Any, job: str) -> str:
    """The name of the job's master pod, run by the master Job (waits for it)."""
    def find() -> str:
        pods = server.list("pods", f"elasticdl-job-name={job},elasticdl-replica-type=master")
        return str(pods[-1]["metadata"]["name"]) if pods else ""

    return str(wait_for(find, 60, f"the master pod of {job}"))


def stop_and_wait_for_cascade(server: Any, kubelet: Any, job: str) -> None:
    """`elasticdl stop`: the master Job goes, and owner references take the rest."""
    from elasticdl_client import k8s

    assert k8s.stop(job, namespace=server.namespace, kubeconfig=server.kubeconfig,
                    out=io.StringIO()) == 0
    wait_for(lambda: not server.list("pods") and not server.list("services")
             and not server.list("secrets") and not server.list("jobs"), 60,
             "owner-reference cascade", lambda: [p["metadata"]["name"]
                                                 for p in server.list("pods")])
    wait_for(lambda: not kubelet.running(), 30, "every pod process to stop")


def test_digits_ps_job_survives_deleted_worker_and_ps_pods(server, kubelet, port_base,
                                                           digits_data, tmp_path):
    from kubernetes import client

    from elasticdl.cluster.k8s_api import load_api_client
    from elasticdl_client import k8s

    job = "e2e-ps"
    ckpt = str(tmp_path / "ckpt")
    submit(server, port_base, digits_data, tmp_path, job,
           "--distribution_strategy=ParameterServerStrategy", "--num_ps_pods=2",
           # long enough to delete pods mid-run: 3 epochs of minibatches of 16 trained in
           # 2.3 s (two CI runs in three: the job was done before the deletion, KeyError
           # 'worker-0'); 10 of 8 take ~7x the steps
           "--num_workers=2", "--num_epochs=10", "--minibatch_size=8",
           "--num_minibatches_per_task=4", f"--checkpoint_dir={ckpt}", "--checkpoint_steps=5",
           "--worker_pod_priority=0.5", "--worker_resource_request=cpu=1,memory=1Gi")
    master = master_pod(server, job)
    report_path = str(tmp_path / "out" / "job_report.json")

    def master_log() -> str:
        return pod_log(server, master)[-6000:]

    # mid-run: both workers up and some records done; then someone deletes worker-0 and,
    # once the PS have checkpointed, ps-0
    wait_for(lambda: server.phase(f"elasticdl-{job}-worker-0") == "Running" and server.phase(
        f"elasticdl-{job}-worker-1") == "Running", 120, "the worker pods to run", master_log)
    wait_for(lambda: records_done(report_path) > 0, 120, "training progress", master_log)
    api = load_api_client(server.kubeconfig)
    try:
        core = client.CoreV1Api(api)
        core.delete_namespaced_pod(f"elasticdl-{job}-worker-0", server.namespace)
        wait_for(lambda: complete_versions(ckpt), 120, "a PS checkpoint", master_log)
        assert server.phase(master) == "Running", "the job ended before the PS was deleted"
        core.delete_namespaced_pod(f"elasticdl-{job}-ps-0", server.namespace)
    finally:
        api.close()

    wait_for(lambda: server.phase(master) in ("Succeeded", "Failed"), 400, "the job to finish",
             master_log)
    assert server.phase(master) == "Succeeded", master_log()
    report = read_report(report_path)
    assert report is not None and report["status"] == "succeeded", report
    assert report["cluster"] == "k8s" and report["num_ps"] == 2
    relaunched = {r["replica"]: r for r in report["relaunches"]}
    assert relaunched["worker-0"]["reason"] == "deleted", report["relaunches"]
    assert relaunched["worker-0"]["new_replica"].startswith("worker-")
    assert (relaunched["ps-0"]["new_replica"], relaunched["ps-0"]["reason"]) == (
        "ps-0", "deleted"), report["relaunches"]
    for epoch in report["epochs"]:
        assert epoch["records_completed"] == report["dataset"]["training_records"]
    assert re.search(r"PS 0 restored version \d+", pod_log(server, f"elasticdl-{job}-ps-0"))

    # the replacement pod ran; PS Services were made; `status` sees the finished job
    new_pod = f"elasticdl-{job}-{relaunched['worker-0']['new_replica']}"
    assert server.phase(new_pod) == "Succeeded", master_log()
    # one Service per PS and the master's; the relaunched ps-0 finds its Service still
    # there (409) and keeps it
    codes = service_creates(server)
    if codes is not None:
        assert len(codes) == 4
        if server.real:
            assert sorted(codes) == [201, 201, 201, 409]
    # the master's close() removed the PS Services again; the master's stays with the Job
    assert [x["metadata"]["name"] for x in server.list("services")] == [f"{job}-master"]
    # the job token travelled in a Secret owned by the master Job, read by env
    secrets = server.list("secrets")
    assert len(secrets) == 1, [(x["metadata"]["name"], x["metadata"].get("ownerReferences"))
                               for x in secrets]
    [secret] = secrets
    token = base64.b64decode(secret["data"]["token"]).decode()
    owner = secret["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "Job" and owner["uid"] == server.get(
        "jobs", f"elasticdl-{job}-master")["metadata"]["uid"]
    env = server.get("pods", new_pod)["spec"]["containers"][0]["env"]
    assert {"name": "ELASTICDL_JOB_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": secret["metadata"]["name"], "key": "token"}}} in env
    assert token not in json.dumps(server.list("pods"))  # never a plain pod value
    assert "(job token, plaintext)" in pod_log(server, master)
    shown = io.StringIO()
    assert k8s.status(job, namespace=server.namespace, kubeconfig=server.kubeconfig,
                      out=shown) == 0
    assert "master        succeeded" in shown.getvalue()
    stop_and_wait_for_cascade(server, kubelet, job)


def test_digits_allreduce_job_status_logs_and_stop(server, kubelet, port_base, digits_data,
                                                    tmp_path):
    from elasticdl_client import k8s

    job = "e2e-ar"
    submit(server, port_base, digits_data, tmp_path, job,
           "--distribution_strategy=AllreduceStrategy", "--num_workers=2", "--num_epochs=1",
           "--minibatch_size=32", "--collective_timeout_s=20")
    master = master_pod(server, job)
    report = finished_report(server, master, str(tmp_path / "out" / "job_report.json"))
    assert report["cluster"] == "k8s" and report["relaunches"] == []
    assert [e["records_completed"] for e in report["epochs"]] == [
        report["dataset"]["training_records"]]
    for i in (0, 1):
        assert server.phase(f"elasticdl-{job}-worker-{i}") == "Succeeded"

    # status and logs through the API server (on a real one: pods/log -> the kubelet)
    shown = io.StringIO()
    assert k8s.status(job, namespace=server.namespace, kubeconfig=server.kubeconfig,
                      out=shown) == 0
    text = shown.getvalue()
    assert "master        succeeded" in text and "worker-1      succeeded" in text
    assert "progress (master log):" in text
    tail = text.split("progress (master log):", 1)[1].strip().splitlines()
    assert tail and tail[-1].strip() in pod_log(server, master)
    log = io.StringIO()
    assert k8s.logs(job, replica="worker-1", namespace=server.namespace,
                    kubeconfig=server.kubeconfig, out=log) == 0
    assert log.getvalue() and log.getvalue() == pod_log(server, f"elasticdl-{job}-worker-1")
    followed = io.StringIO()  # a finished pod: --follow prints all and returns
    assert k8s.logs(job, replica="master", namespace=server.namespace, follow=True,
                    kubeconfig=server.kubeconfig, out=followed) == 0
    assert followed.getvalue() == pod_log(server, master)
    stop_and_wait_for_cascade(server, kubelet, job)
