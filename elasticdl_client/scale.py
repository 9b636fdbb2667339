"""``elasticdl scale JOB --num_workers=N|MIN:MAX``: resize a running job.

Local jobs: the master's ``scale`` RPC (its port from ``master.json``, the job
token from the job directory). Kubernetes jobs: the wanted size is written as
the annotation ``elasticdl.org/num-workers`` of the master pod (``patch`` on
pods, granted by ``elasticdl rbac``); the master watches its pod and resizes.
Either way the master adds workers or retires some (a retired worker finishes
its task, then is stopped), and records the resize in the job report.
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Optional

from elasticdl.common.job_spec import JobSpecError, parse_worker_range

USAGE_ERROR, FAILED = 2, 1
ANNOTATION = "elasticdl.org/num-workers"


def _error(message: str, code: int, out: IO[str]) -> int:
    print(f"elasticdl scale: {message}", file=out)
    return code


def scale(job_name: str, num_workers: object = None, namespace: str = "default",
          cluster: str = "", kubeconfig: Optional[str] = None,
          out: IO[str] = sys.stdout) -> int:
    """Resize a running job to ``--num_workers=N`` (fixed) or ``MIN:MAX``.

    Args:
      job_name: the job's name
      num_workers: N or MIN:MAX
      namespace: Kubernetes namespace
      cluster: local or k8s (default: local if such a local job exists)
    """
    if num_workers is None:
        return _error("--num_workers=N or --num_workers=MIN:MAX is required", USAGE_ERROR,
                      sys.stderr)
    try:
        low, high = parse_worker_range(str(num_workers).replace(" ", ""))
    except JobSpecError as e:
        return _error(str(e), USAGE_ERROR, sys.stderr)
    from elasticdl_client import local_cluster

    job_dir = None
    if cluster != "k8s":
        try:
            job_dir = local_cluster.find_job(job_name)
        except local_cluster.JobNotFound:
            if cluster == "local":
                return _error(f"no local job named {job_name!r}", USAGE_ERROR, sys.stderr)
    if job_dir is not None:
        return _scale_local(job_dir, job_name, low, high, out)
    return _scale_k8s(job_name, namespace, low, high, kubeconfig, out)


def _scale_local(job_dir: str, job_name: str, low: int, high: int, out: IO[str]) -> int:
    import grpc

    from elasticdl.common import auth
    from elasticdl.common.wire import GRPC_OPTIONS
    from elasticdl.proto import elasticdl_pb2 as pb
    from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc

    try:
        with open(os.path.join(job_dir, "master.json")) as f:
            port = int(json.load(f)["port"])
    except (OSError, ValueError, KeyError) as e:
        return _error(f"job {job_name}: no master address in {job_dir} ({e})", FAILED,
                      sys.stderr)
    channel = auth.client_channel(f"127.0.0.1:{port}", GRPC_OPTIONS,
                                  job_secrets=auth.read_job_secrets(job_dir))
    try:
        size = pb_grpc.MasterStub(channel).scale(
            pb.ScaleRequest(min_workers=low, max_workers=high,
                            reason=f"elasticdl scale --num_workers={low}:{high}"), timeout=30)
    except grpc.RpcError as e:
        return _error(f"job {job_name}: the master refused or is not running "
                      f"({e.code().name}: {e.details()})", FAILED, sys.stderr)
    finally:
        channel.close()
    print(f"job {job_name}: workers MIN:MAX {size.min_workers}:{size.max_workers} "
          f"({size.running_workers} running, {size.pending_workers} pending, "
          f"{size.retiring_workers} retiring)", file=out)
    return 0


def _scale_k8s(job_name: str, namespace: str, low: int, high: int,
               kubeconfig: Optional[str], out: IO[str]) -> int:
    from elasticdl.cluster import manifests as mf
    from elasticdl.cluster.api import ClusterError, ReplicaType
    from elasticdl.cluster.k8s_api import API_ERRORS, api_error, list_pods, load_api_client
    from elasticdl.cluster.pod_status import replica_of

    try:
        api = load_api_client(kubeconfig)
    except ClusterError as e:
        return _error(str(e), FAILED, sys.stderr)
    from kubernetes import client

    core = client.CoreV1Api(api)
    try:
        pods, _ = list_pods(core, namespace, mf.job_selector(job_name))
        masters = [p for p in pods if (replica_of(p) or (None,))[0] == ReplicaType.MASTER
                   and not p["metadata"].get("deletionTimestamp")]
        if not masters:
            return _error(f"no running master of job {job_name} in namespace {namespace}",
                          FAILED, sys.stderr)
        name = masters[0]["metadata"]["name"]
        core.patch_namespaced_pod(name, namespace,
                                  {"metadata": {"annotations": {ANNOTATION: f"{low}:{high}"}}})
    except API_ERRORS as e:
        return _error(str(api_error(e, f"annotate the master pod of {job_name}")), FAILED,
                      sys.stderr)
    finally:
        api.close()
    print(f"job {job_name}: asked its master (pod {name}) for workers MIN:MAX {low}:{high}",
          file=out)
    return 0
