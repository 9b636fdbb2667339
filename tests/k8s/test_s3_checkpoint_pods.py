"""A Kubernetes job whose pods share no disk writes its checkpoints to object storage: each
pod stages its own (the test kubelet gives every pod its own ``ELASTICDL_HOME``), each PS
uploads its shard and the last one up completes the version; a deleted PS pod comes back in
a fresh pod and restores its shard from the bucket; the credentials reach every pod only as
a reference to a Secret (``--data_secret``), never as a value in a pod spec. On the genuine
control plane (the Node authorizer lets the kubelet read only the Secrets of its pods) with
the SeaweedFS S3 server of the object-storage tier."""

from __future__ import annotations

import base64
import json
import os
import re

import pytest

from elasticdl.checkpoint import remote
from elasticdl.data import fs
from tests.k8s.test_e2e import (
    finished_report,
    master_pod,
    pod_log,
    read_report,
    records_done,
    submit,
    wait_for,
)
from tests.s3.conftest import s3_digits, s3_server  # noqa: F401 - the session's S3 tier
from tests.s3.seaweed import ACCESS_KEY, SECRET_KEY

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real]

BUCKET = "k8s-checkpoints"
CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


@pytest.fixture
def pods_without_a_shared_disk(server, kubelet, s3_server):  # noqa: F811
    """The S3 bucket, a Secret ``s3-credentials`` with its keys, and a kubelet that gives
    every pod its own ``ELASTICDL_HOME`` and no credential from the environment."""
    from kubernetes import client

    fsys = s3_server.filesystem()
    if not fsys.exists(BUCKET):
        fsys.mkdir(BUCKET)
    client.CoreV1Api(server.admin).create_namespaced_secret(server.namespace, client.V1Secret(
        metadata=client.V1ObjectMeta(name="s3-credentials"),
        string_data={"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                     "AWS_DEFAULT_REGION": "us-east-1"}))
    kubelet.pod_home = True                       # every pod its own disk
    kubelet.unset_env = set(CREDENTIALS) | {"AWS_ENDPOINT_URL"}   # only the Secret has them
    return f"s3://{BUCKET}/{server.namespace}"


# its waits add up to 760 s: under pytest's 300 s default a slow run (a CI run with a
# benchmark beside it) was cut before the wait that prints the master's log could
@pytest.mark.timeout(900)
def test_ps_job_on_s3_csv_checkpoints_to_s3_from_pods_with_no_shared_disk(
        server, kubelet, port_base, digits_data, tmp_path, s3_server, s3_digits,  # noqa: F811
        pods_without_a_shared_disk):
    from kubernetes import client

    url = pods_without_a_shared_disk
    core = client.CoreV1Api(server.admin)
    job = "s3-ckpt"
    submit(server, port_base, digits_data, tmp_path, job,
           "--distribution_strategy=ParameterServerStrategy", "--num_ps_pods=2",
           "--num_workers=2", "--num_epochs=3", "--minibatch_size=16",
           "--num_minibatches_per_task=4", f"--checkpoint_dir={url}", "--checkpoint_steps=5",
           "--keep_checkpoint_max=2", f"--data_endpoint={s3_server.endpoint}",
           "--data_secret=s3-credentials", train=s3_digits["train_csv"][0],
           val=s3_digits["val_csv"][0])
    master = master_pod(server, job)
    report_path = str(tmp_path / "out" / "job_report.json")

    def master_log() -> str:
        return pod_log(server, master)[-6000:] + "\n--- ps-0:\n" + pod_log(
            server, f"elasticdl-{job}-ps-0")[-3000:]

    wait_for(lambda: records_done(report_path) > 0, 180, "training progress", master_log)
    wait_for(lambda: remote.remote_versions(url), 180, "a complete version in the bucket",
             master_log)
    first = remote.remote_versions(url)[-1]
    names = {n for n, _ in fs.list_entries(f"{url}/version-{first}")}
    assert {"ps-0-of-2.pt", "ps-1-of-2.pt", "DONE"} <= names, names
    assert server.phase(master) == "Running", "the job ended before the PS was deleted"
    core.delete_namespaced_pod(f"elasticdl-{job}-ps-0", server.namespace)

    wait_for(lambda: server.phase(master) in ("Succeeded", "Failed"), 400, "the job to finish",
             master_log)
    assert server.phase(master) == "Succeeded", master_log()
    report = read_report(report_path)
    assert report is not None and report["status"] == "succeeded", report
    for epoch in report["epochs"]:
        assert epoch["records_completed"] == report["dataset"]["training_records"]
    relaunched = {r["replica"]: r for r in report["relaunches"]}
    assert relaunched["ps-0"]["reason"] == "deleted", report["relaunches"]
    # the data: CSV objects the master indexed once; every task carried its byte span, so
    # no worker streamed an object to index it (each task one ranged GET)
    assert "indexed s3://" in pod_log(server, master)
    for pod in server.list("pods", f"elasticdl-job-name={job},elasticdl-replica-type=worker"):
        assert "indexed s3://" not in pod_log(server, pod["metadata"]["name"])
    # the new ps-0 pod restored from the bucket, into its own (fresh) staging directory
    log = pod_log(server, f"elasticdl-{job}-ps-0")
    restored = re.findall(r"PS 0 restored version (\d+)", log)
    assert restored and int(restored[-1]) >= first, log[-3000:]
    homes = os.listdir(os.path.join(kubelet.work_dir, "homes"))
    assert len([h for h in homes if h.startswith(f"elasticdl-{job}-ps-0-")]) == 2, homes
    # the bucket: complete versions with every shard, retention applied (the newest 2 and
    # what their deltas need), the task table beside them
    versions = remote.remote_versions(url)
    assert versions and versions[-1] > first, versions
    for v in versions:
        names = {n for n, _ in fs.list_entries(f"{url}/version-{v}")}
        assert {"ps-0-of-2.pt", "ps-1-of-2.pt", "DONE"} <= names, (v, names)
    # retention: nothing older than what the newest 2 are folded onto (a PS delta chain is
    # at most full_checkpoint_every = 8 long), so 2 + 7 versions at most
    floor = min([versions[-2]] + [
        json.loads(fs.read_bytes(f"{url}/version-{v}/{n}"))["full_version"]
        for v in versions[-2:] for n, _ in fs.list_entries(f"{url}/version-{v}")
        if n.endswith(".delta.json")])
    assert versions[0] == floor and len(versions) <= 2 + 7, versions
    assert any(not is_dir for _, is_dir in fs.list_entries(url))   # the task table
    # no credential in any pod spec: a reference to the Secret only
    pods = server.list("pods", f"elasticdl-job-name={job}")
    assert pods
    dumped = json.dumps(pods)
    assert SECRET_KEY not in dumped and ACCESS_KEY not in dumped
    for pod in pods:
        assert pod["spec"]["containers"][0]["envFrom"] == [
            {"secretRef": {"name": "s3-credentials"}}], pod["metadata"]["name"]
    secret = core.read_namespaced_secret("s3-credentials", server.namespace)
    assert base64.b64decode(secret.data["AWS_SECRET_ACCESS_KEY"]).decode() == SECRET_KEY


def test_allreduce_job_checkpoints_to_s3_and_an_evaluate_job_reads_them(
        server, kubelet, port_base, digits_data, tmp_path, s3_server,  # noqa: F811
        pods_without_a_shared_disk):
    """Allreduce: the writing worker's pod uploads each version (``DONE`` last); an
    ``evaluate`` job then loads the newest from the bucket in pods that never saw it."""
    import subprocess
    import sys

    from tests.conftest import MODEL_ZOO, ROOT

    url = pods_without_a_shared_disk + "-ar"
    job = "s3-ar"
    submit(server, port_base, digits_data, tmp_path, job,
           "--distribution_strategy=AllreduceStrategy", "--num_workers=2", "--num_epochs=1",
           "--minibatch_size=32", "--collective_timeout_s=20", f"--checkpoint_dir={url}",
           "--checkpoint_steps=10", "--keep_checkpoint_max=2",
           f"--data_endpoint={s3_server.endpoint}", "--data_secret=s3-credentials")
    finished_report(server, master_pod(server, job), str(tmp_path / "out" / "job_report.json"))
    versions = remote.remote_versions(url)
    assert 1 <= len(versions) <= 2, versions
    for v in versions:
        assert {n for n, _ in fs.list_entries(f"{url}/version-{v}")} >= {"model.pt", "DONE"}

    env = dict(os.environ, KUBECONFIG=server.kubeconfig, ELASTICDL_K8S_PORT_BASE=str(port_base),
               ELASTICDL_HOME=str(tmp_path / "home"), PYTHONPATH=ROOT)
    out = tmp_path / "eval-out"
    cli = subprocess.run(
        [sys.executable, "-m", "elasticdl_client.main", "evaluate",
         "--image_name=registry.local/digits:v1", "--image_pull_policy=IfNotPresent",
         f"--model_zoo={MODEL_ZOO}", "--model_def=digits.digits_cnn.custom_model",
         f"--validation_data={digits_data}/val", f"--checkpoint_dir_for_init={url}",
         f"--output={out}", "--job_name=s3-eval", f"--namespace={server.namespace}",
         f"--data_endpoint={s3_server.endpoint}", "--data_secret=s3-credentials"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    evaluated = finished_report(server, master_pod(server, "s3-eval"),
                                str(out / "job_report.json"))
    assert evaluated["model_version"] == versions[-1], evaluated
    assert json.dumps(evaluated).count("accuracy") and SECRET_KEY not in json.dumps(
        server.list("pods"))
