"""Elastic scheduling on a genuine control plane (issue 22; ``k8s_real``): the real
kube-scheduler decides which worker pods run, with GPUs (``nvidia.com/gpu``) as
the scarce resource.

* A ``--num_workers=2:4`` job (async PS, sync PS with a group of 4, allreduce) on a
  node with 2 GPUs starts with 2 workers
  (2 pending, with the scheduler's reason in the report), grows to 4 when a second
  node with 2 GPUs is registered (served by a second test kubelet), shrinks when a
  high-priority pod preempts 2 of its low-priority workers (reported as
  ``preempted``, not failures) and grows back when that pod ends; every record is
  trained exactly once per epoch (the record-counting model).
  ``elasticdl scale --num_workers=2`` (the annotation path, as the user bound to the
  Role of ``elasticdl rbac``) then retires 2 workers mid-epoch, none replaced, and
  ``--num_workers=3`` launches one that joins the running job.
* A job (each strategy) none of whose workers can ever be scheduled fails after
  ``--min_workers_timeout_s`` naming the scheduler's reason (never waits forever).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import FIXTURE_ZOO, ROOT
from tests.k8s.kubelet import NODE, FakeKubelet
from tests.k8s.test_e2e import master_pod, pod_log, read_report, wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real]

RECORDS = 1536   # time left for the last resize (up to 3) before the end
EPOCHS = 2
GPU = "nvidia.com/gpu"


def _gpus(core: Any, node: str, n: int) -> None:
    core.patch_node_status(node, {"status": {"capacity": {GPU: str(n)},
                                             "allocatable": {GPU: str(n)}}})


def _submit(server, port_base, tmp_path, job, *flags, gpus=1) -> subprocess.CompletedProcess:
    env = dict(os.environ, KUBECONFIG=server.kubeconfig, ELASTICDL_K8S_PORT_BASE=str(port_base),
               ELASTICDL_HOME=str(tmp_path / "home"), PYTHONPATH=ROOT)
    data = tmp_path / "ids"
    data.mkdir(exist_ok=True)
    np.save(data / "ids.npy", np.arange(RECORDS, dtype=np.int64))
    return subprocess.run(
        [sys.executable, "-m", "elasticdl_client.main", "train",
         "--image_name=registry.local/toy:v1", "--image_pull_policy=IfNotPresent",
         f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.count_records.custom_model",
         f"--training_data={data}", f"--output={tmp_path / 'out'}", f"--job_name={job}",
         f"--namespace={server.namespace}", "--worker_resource_request=cpu=0.1,memory=128Mi",
         f"--worker_resource_limit=gpu={gpus}", "--worker_pod_priority=low", *flags],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def _workers(report_path: str) -> dict[str, Any]:
    return (read_report(report_path) or {}).get("workers") or {}


def _add_node(server, tmp_path, kubelet_env) -> tuple[str, FakeKubelet]:
    from kubernetes import config

    from tests.k8s.realcluster import free_port

    plane = server.plane
    name = f"node-{uuid.uuid4().hex[:6]}"
    subprocess.run([os.path.join(plane.scripts, "node.sh"), plane.dir, name],
                   env=dict(os.environ, NODE_GPU="2", KUBELET_PORT=str(free_port())),
                   check=True, capture_output=True, text=True, timeout=60)
    api = config.new_client_from_config(
        config_file=os.path.join(plane.dir, f"node-{name}.kubeconfig"), persist_config=False)
    work = tmp_path / name
    work.mkdir()
    return name, FakeKubelet(api, server.log_dir, str(work), extra_env=kubelet_env, grace_s=1.0,
                             node=name, namespaces={server.namespace})


STRATEGIES = {
    "ps-async": ("--distribution_strategy=ParameterServerStrategy", "--use_async=true",
                 "--num_ps_pods=1"),
    # a sync group of 4 pushes: while fewer run, the PS complete it at the running count
    "ps-sync": ("--distribution_strategy=ParameterServerStrategy", "--grads_to_wait=4",
                "--num_ps_pods=1"),
    "allreduce": ("--distribution_strategy=AllreduceStrategy",),
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_elastic_job_starts_at_min_grows_with_a_node_and_shrinks_when_preempted(
        strategy, server, kubelet, port_base, tmp_path):
    from kubernetes import client

    if not server.plane.own:
        pytest.skip("registers a node: needs the tier's own control plane")
    core = client.CoreV1Api(server.admin)
    job, report_path = f"elastic-{strategy}", str(tmp_path / "out" / "job_report.json")
    _gpus(core, NODE, 2)
    extra: list[tuple[str, FakeKubelet]] = []
    try:
        cli = _submit(server, port_base, tmp_path, job, *STRATEGIES[strategy],
                      "--num_workers=2:4", f"--num_epochs={EPOCHS}",
                      "--minibatch_size=4", "--num_minibatches_per_task=8",
                      f"--envs=COUNT_RECORDS={RECORDS},COUNT_RECORDS_DELAY_S=0.3")
        assert cli.returncode == 0, cli.stdout + cli.stderr
        master = master_pod(server, job)

        def log() -> str:
            return pod_log(server, master)[-5000:]

        # under-provisioned: trains with 2 while 2 wait, with the scheduler's reason
        wait_for(lambda: (w := _workers(report_path)).get("running") == 2 and
                 w.get("pending") == 2 and sum(e["records_completed"] for e in
                                                (read_report(report_path) or {})["epochs"]),
                 180, "training with 2 running, 2 pending", log)
        reasons = _workers(report_path)["pending_reasons"]
        assert any(f"Insufficient {GPU}" in r for r in reasons), reasons
        # a node with 2 more GPUs joins: the pending workers run there
        extra.append(_add_node(server, tmp_path, dict(kubelet.extra_env)))
        wait_for(lambda: _workers(report_path).get("running") == 4, 120, "4 running", log)
        # a high-priority pod needing 2 GPUs preempts 2 low-priority workers
        core.create_namespaced_pod(server.namespace, {
            "metadata": {"name": "hog"},
            "spec": {"priorityClassName": "high", "restartPolicy": "Never",
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "hog", "image": "busybox",
                                     "command": ["python", "-c", "import time; time.sleep(15)"],
                                     "resources": {"limits": {GPU: "2"}}}]}})
        wait_for(lambda: _workers(report_path).get("preempted", 0) >= 1, 120,
                 "workers preempted", log)
        wait_for(lambda: server.phase("hog") == "Succeeded", 120, "the hog pod to end", log)
        wait_for(lambda: _workers(report_path).get("running") == 4, 120, "4 running again",
                 log)
        # `elasticdl scale` as `user` (the Role of `elasticdl rbac`): down to 2, mid-epoch
        env = dict(os.environ, KUBECONFIG=server.kubeconfig, PYTHONPATH=ROOT)
        scaled = subprocess.run([sys.executable, "-m", "elasticdl_client.main", "scale", job,
                                 "--num_workers=2", f"--namespace={server.namespace}",
                                 "--cluster=k8s"], env=env, cwd=ROOT, capture_output=True,
                                text=True, timeout=60)
        assert scaled.returncode == 0, scaled.stdout + scaled.stderr
        wait_for(lambda: (w := _workers(report_path)).get("running") == 2 and
                 not w.get("retiring") or server.phase(master) == "Succeeded", 120,
                 "2 workers retired", log)
        # ... and up to 3, mid-epoch: the master launches a worker, which joins the job
        scaled = subprocess.run([sys.executable, "-m", "elasticdl_client.main", "scale", job,
                                 "--num_workers=3", f"--namespace={server.namespace}",
                                 "--cluster=k8s"], env=env, cwd=ROOT, capture_output=True,
                                text=True, timeout=60)
        assert scaled.returncode == 0, scaled.stdout + scaled.stderr
        wait_for(lambda: _workers(report_path).get("running") == 3, 120, "3 running", log)
        wait_for(lambda: server.phase(master) in ("Succeeded", "Failed"), 400, "the job end",
                 log)
        assert server.phase(master) == "Succeeded", log()
    finally:
        _gpus(core, NODE, 8)
        for name, k in extra:
            k.close()
            core.delete_node(name)
    report = read_report(report_path)
    assert report is not None and report["status"] == "succeeded", report
    assert [e["records_completed"] for e in report["epochs"]] == [RECORDS] * EPOCHS
    reasons = {r["reason"] for r in report["relaunches"]}
    assert reasons == {"preempted"}, (report["relaunches"], [
        line for line in pod_log(server, master).splitlines()
        if "pod elasticdl-" in line or "Preempted" in line or "relaunch" in line][-60:])
    w = report["workers"]
    assert w["preempted"] >= 1 and (w["min"], w["max"]) == (3, 3)
    assert [(r["from"], r["to"]) for r in w["resizes"]] == [("2:4", "2:2"), ("2:2", "3:3")]
    running = [p[1] for p in w["timeline"]]
    top = running.index(4)   # 2 -> 4 (node added) -> 2 (preempted) -> 4 -> 2 -> 3 (scaled)
    back = running.index(4, running.index(2, top))
    assert 2 in running[:top] and 3 in running[running.index(2, back):], w["timeline"]
    assert w["time_under_min_s"] < 5, w  # 2 of MIN 2 ran from the start
    state = torch.load(os.path.join(tmp_path / "out", "model.pt"), weights_only=True)
    for name in ("even", "odd"):
        wrong = (state[name] != EPOCHS).nonzero().flatten().tolist()
        assert not wrong, f"{name}: {len(wrong)} records not trained {EPOCHS} times"


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_all_workers_unschedulable_fails_after_the_bound_naming_the_reason(
        strategy, server, kubelet, port_base, tmp_path):
    job, report_path = f"never-{strategy}", str(tmp_path / "out" / "job_report.json")
    cli = _submit(server, port_base, tmp_path, job, *STRATEGIES[strategy],
                  "--num_workers=1:2", "--min_workers_timeout_s=5",
                  "--on_min_workers_timeout=fail", gpus=64)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    master = master_pod(server, job)
    started = time.monotonic()
    wait_for(lambda: server.phase(master) in ("Succeeded", "Failed"), 180, "the job to fail",
             lambda: pod_log(server, master)[-4000:])
    assert server.phase(master) == "Failed"
    assert time.monotonic() - started < 120
    report = read_report(report_path)
    assert report is not None and report["status"] == "failed"
    error = report["failure"]["error"]
    assert "0 of MIN 1 workers running" in error and f"Insufficient {GPU}" in error, error
    assert report["workers"]["running"] == 0 and report["workers"]["time_under_min_s"] >= 5
    # nothing of the job is left pending
    wait_for(lambda: not [p for p in server.list("pods")
                          if "worker" in p["metadata"]["name"]
                          and p["status"].get("phase") == "Pending"], 60, "workers removed")


def test_elastic_scheduling_benchmark_smoke(control_plane, tmp_path):
    """benchmarks/elastic_scheduling.py --smoke on this session's control plane: one tiny
    gang/elastic pair of async PS jobs, each ending with every record trained once."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import elastic_scheduling
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    args = elastic_scheduling.parse_args(["--smoke", f"--workdir={tmp_path}"])
    results = elastic_scheduling.run(args, control_plane)
    [row] = results["ps"]
    assert row["gang_makespan_s"] > 0 and row["elastic_makespan_s"] > 0
    # the ratio is of the unrounded makespans; the row shows them to 0.1 s
    ratio = row["elastic_makespan_s"] / row["gang_makespan_s"]
    assert abs(row["makespan_ratio"] - ratio) <= 0.1 / row["gang_makespan_s"] * (1 + ratio)
