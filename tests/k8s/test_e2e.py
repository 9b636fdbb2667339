"""End to end on the stand-in: `elasticdl train --image_name=...` -> master pod ->
PS and worker pods -> a worker pod deleted mid-run -> relaunch -> success.

Everything real except the cluster: the CLI submits through the official
client, the test kubelet runs the master pod's `python -m elasticdl.master.main`
which creates PS/worker pods through KubernetesCluster, and the kubelet runs
those too. What this cannot show (scheduling, images, pod networking and DNS)
is listed in docs/kubernetes.md.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

import pytest

from tests.conftest import MODEL_ZOO, ROOT

JOB = "e2e-digits"
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


def test_digits_ps_job_survives_a_deleted_worker_pod(apiserver, kubelet, kubeconfig, port_base,
                                                     digits_data, tmp_path):
    from kubernetes import client

    from elasticdl.cluster.k8s_api import load_api_client
    from elasticdl_client import k8s

    out = tmp_path / "out"
    env = dict(os.environ, KUBECONFIG=kubeconfig, ELASTICDL_K8S_PORT_BASE=str(port_base),
               ELASTICDL_HOME=str(tmp_path / "home"), PYTHONPATH=ROOT)
    cli = subprocess.run(
        [sys.executable, "-m", "elasticdl_client.main", "train",
         "--image_name=registry.local/digits:v1", "--image_pull_policy=IfNotPresent",
         f"--model_zoo={MODEL_ZOO}", "--model_def=digits.digits_cnn.custom_model",
         f"--training_data={digits_data}/train", f"--validation_data={digits_data}/val",
         "--distribution_strategy=ParameterServerStrategy", "--num_ps_pods=2",
         "--num_workers=2", "--num_epochs=2", "--minibatch_size=16",
         "--num_minibatches_per_task=4", f"--output={out}", f"--job_name={JOB}",
         "--worker_pod_priority=0.5", "--worker_resource_request=cpu=1,memory=1Gi"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "submitted job" in cli.stdout

    master = f"elasticdl-{JOB}-master"
    victim = f"elasticdl-{JOB}-worker-0"
    report_path = str(out / "job_report.json")

    def master_log() -> str:
        path = os.path.join(apiserver.log_dir, "default", f"{master}.log")
        return open(path).read()[-6000:] if os.path.exists(path) else "(no master log)"

    def phase(name: str) -> str:
        pod = apiserver.get("pods", "default", name)
        return pod["status"].get("phase", "") if pod else ""

    # mid-run: both workers up and some records done, then someone deletes worker-0
    wait_for(lambda: phase(victim) == "Running" and phase(f"elasticdl-{JOB}-worker-1")
             == "Running", 120, "the worker pods to run", master_log)
    wait_for(lambda: any(e.get("records_completed", 0) > 0
                         for e in (read_report(report_path) or {}).get("epochs", [])),
             120, "training progress", master_log)
    api = load_api_client(kubeconfig)
    try:
        client.CoreV1Api(api).delete_namespaced_pod(victim, "default")
    finally:
        api.close()

    wait_for(lambda: phase(master) in ("Succeeded", "Failed"), 300, "the job to finish",
             master_log)
    assert phase(master) == "Succeeded", master_log()
    report = read_report(report_path)
    assert report is not None and report["status"] == "succeeded", report
    assert report["cluster"] == "k8s" and report["num_ps"] == 2
    deleted = [r for r in report["relaunches"] if r["replica"] == "worker-0"]
    assert deleted and deleted[0]["reason"] == "deleted", report["relaunches"]
    assert deleted[0]["new_replica"].startswith("worker-")
    for epoch in report["epochs"]:
        assert epoch["records_completed"] == report["dataset"]["training_records"]

    # the replacement pod ran; PS Services were made; `status` sees the finished job
    new_pod = f"elasticdl-{JOB}-{deleted[0]['new_replica']}"
    assert phase(new_pod) == "Succeeded", master_log()
    made = [p for m, p in apiserver.requests if m == "POST" and p.endswith("/services")]
    assert len(made) == 2  # one Service per PS; the master's close() removed them again
    assert apiserver.list("services") == []
    # the job token travelled in a Secret owned by the master pod, read by env
    [secret] = apiserver.list("secrets")
    token = base64.b64decode(secret["data"]["token"]).decode()
    owner = secret["metadata"]["ownerReferences"][0]
    assert owner["name"] == master and owner["uid"] == apiserver.get(
        "pods", "default", master)["metadata"]["uid"]
    env = apiserver.get("pods", "default", new_pod)["spec"]["containers"][0]["env"]
    assert {"name": "ELASTICDL_JOB_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": secret["metadata"]["name"], "key": "token"}}} in env
    assert token not in json.dumps(apiserver.list("pods"))  # never a plain pod value
    with open(os.path.join(apiserver.log_dir, "default", f"{master}.log")) as f:
        assert "(job token, plaintext)" in f.read()
    shown = io.StringIO()
    assert k8s.status(JOB, kubeconfig=kubeconfig, out=shown) == 0
    assert "master        succeeded" in shown.getvalue()
    # stop: the master pod goes and takes every remaining replica and Service along
    assert k8s.stop(JOB, kubeconfig=kubeconfig, out=io.StringIO()) == 0
    wait_for(lambda: not apiserver.list("pods") and not apiserver.list("services")
             and not apiserver.list("secrets"), 10, "owner-reference cascade")
    wait_for(lambda: not kubelet.running(), 10, "every pod process to stop")
