"""Fixtures: an API server (the stand-in, or a genuine one), kubeconfigs, a test kubelet.

Tests that take ``server`` (directly or through ``kubeconfig``, ``kubelet``,
``api_client``) run twice: against the stand-in (``tests/k8s/apiserver.py``)
and, marked ``k8s_real``, against a genuine control plane started once per
session (``tests/k8s/realcluster.py``; skipped with a one-line reason when its
binaries or etcd are absent). Tests that take ``apiserver`` use the
stand-in's internals (request log, 403 mode, dropped watches) and run only
there. Nothing here needs Docker or the network beyond 127.0.0.1.
"""

from __future__ import annotations

import json
import random
import socket
from collections.abc import Iterator
from typing import Any, Optional

import pytest

pytest.importorskip("kubernetes")

from kubernetes import client, config  # noqa: E402

from tests.k8s import realcluster  # noqa: E402
from tests.k8s.apiserver import FakeApiServer  # noqa: E402
from tests.k8s.jobcontroller import FakeJobController  # noqa: E402
from tests.k8s.kubelet import NODE, FakeKubelet  # noqa: E402

pytestmark = pytest.mark.k8s


def write_kubeconfig(path: str, server: str, token: str) -> str:
    """A kubeconfig with one context for ``server`` and a bearer token."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"""apiVersion: v1
kind: Config
clusters:
- name: stand-in
  cluster:
    server: {server}
users:
- name: {token}
  user:
    token: {token}
contexts:
- name: stand-in
  context:
    cluster: stand-in
    user: {token}
    namespace: default
current-context: stand-in
""")
    return path


def free_port_base() -> int:
    """A port base P such that the master (P), PS 0-3 (P+1..P+4), the master's
    metrics endpoint (P+1000, ``K8S_METRICS_PORT_OFFSET``) and workers 0-7
    (P+1001..P+1008) ports were free a moment ago. Bases lie in 10000-18900, below
    the ephemeral range (32768-60999 here), where other processes' connections
    took ports of a range picked inside it. Tried in a random order: the suite's
    stand-in tests and the real tier beside it (two processes) probing the same bases in
    the same order took the same one (a master's metrics port then in use)."""
    bases = list(range(10000, 18900 - 1008, 20))   # ranges of different bases interleave
    random.shuffle(bases)
    for base in bases:
        probe = [base + i for i in range(5)] + [base + 1000 + i for i in range(9)]
        try:
            for port in probe:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range found on 127.0.0.1")


def pytest_generate_tests(metafunc: Any) -> None:
    """``server``: both servers; only the stand-in for tests that take ``apiserver``;
    only the real one for tests marked ``k8s_real``."""
    if "server" in metafunc.fixturenames:
        params: list[Any] = []
        if not metafunc.definition.get_closest_marker("k8s_real"):
            params.append("stand-in")
        if "apiserver" not in metafunc.fixturenames:
            params.append(pytest.param("real", marks=pytest.mark.k8s_real))
        metafunc.parametrize("server", params, indirect=True)


class Server:
    """What a test sees of either server: the user's kubeconfig, a namespace, and
    reads as an administrator (plain dicts, as the API sent them)."""

    def __init__(self, kind: str, kubeconfig: str, namespace: str, log_dir: str,
                 admin: client.ApiClient, fake: Optional[FakeApiServer] = None,
                 plane: Optional[realcluster.ControlPlane] = None):
        self.kind, self.kubeconfig, self.namespace = kind, kubeconfig, namespace
        self.log_dir, self.admin, self.fake, self.plane = log_dir, admin, fake, plane

    @property
    def real(self) -> bool:
        return self.kind == "real"

    def get(self, kind: str, name: str) -> Optional[dict[str, Any]]:
        core = client.CoreV1Api(self.admin)
        batch = client.BatchV1Api(self.admin)
        read = {"pods": core.read_namespaced_pod, "services": core.read_namespaced_service,
                "secrets": core.read_namespaced_secret, "jobs": batch.read_namespaced_job}[kind]
        try:
            resp = read(name, self.namespace, _preload_content=False)
        except client.exceptions.ApiException as e:
            if e.status == 404:
                return None
            raise
        return json.loads(resp.data)

    def list(self, kind: str, selector: str = "") -> list[dict[str, Any]]:
        """Objects of ``kind`` in the namespace; for secrets not the service-account
        tokens a real server keeps there."""
        core = client.CoreV1Api(self.admin)
        fn = {"pods": core.list_namespaced_pod, "services": core.list_namespaced_service,
              "secrets": core.list_namespaced_secret,
              "jobs": client.BatchV1Api(self.admin).list_namespaced_job}[kind]
        items = json.loads(fn(self.namespace, label_selector=selector,
                              _preload_content=False).data)["items"]
        if kind == "secrets":
            items = [i for i in items if i.get("type") != "kubernetes.io/service-account-token"]
        return list(items)

    def phase(self, name: str) -> str:
        pod = self.get("pods", name)
        return str(pod["status"].get("phase", "")) if pod else ""


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line saying why the real-cluster tier was skipped (not one per test)."""
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if "real Kubernetes tier:" in str(r.longrepr)]
    if skipped:
        reason = str(skipped[0].longrepr[2]) if isinstance(skipped[0].longrepr, tuple) \
            else str(skipped[0].longrepr)
        terminalreporter.write_line(f"{len(skipped)} k8s_real tests skipped: "
                                    f"{reason.removeprefix('Skipped: ')}")


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory) -> Iterator[realcluster.ControlPlane]:
    """A genuine control plane, once per session (skips with the reason if it cannot)."""
    reason = realcluster.unavailable()
    if reason:
        pytest.skip(f"real Kubernetes tier: {reason}")
    plane = realcluster.start(str(tmp_path_factory.mktemp("control-plane")))
    try:
        api = realcluster.admin_client(plane.admin_kubeconfig)
        realcluster.ensure_priority_classes(api)
        api.close()
        yield plane
    finally:
        plane.close()


@pytest.fixture
def server(request, tmp_path) -> Iterator[Server]:
    log_dir = str(tmp_path / "pod-logs")
    if request.param == "stand-in":
        fake = FakeApiServer(log_dir)
        jobs = FakeJobController(fake)  # the real tier runs kube-controller-manager's
        path = write_kubeconfig(str(tmp_path / "admin.kubeconfig"), fake.url, "admin")
        admin = config.new_client_from_config(config_file=path, persist_config=False)
        yield Server("stand-in", write_kubeconfig(str(tmp_path / "kubeconfig"), fake.url,
                                                  "user"), "default", log_dir, admin, fake=fake)
        admin.close()
        jobs.close()
        fake.close()
        return
    plane = request.getfixturevalue("control_plane")
    admin = realcluster.admin_client(plane.admin_kubeconfig)
    ns = realcluster.make_namespace(admin, user_is_admin=not plane.own)
    yield Server("real", plane.user_kubeconfig, ns, log_dir, admin, plane=plane)
    realcluster.drop_namespace(admin, ns)
    admin.close()


@pytest.fixture
def apiserver(server) -> FakeApiServer:
    assert server.fake is not None
    return server.fake


@pytest.fixture
def kubeconfig(server) -> str:
    """The user's kubeconfig (token ``user``)."""
    return str(server.kubeconfig)


@pytest.fixture
def api_client(kubeconfig) -> Iterator[client.ApiClient]:
    api = config.new_client_from_config(config_file=kubeconfig, persist_config=False)
    yield api
    api.close()


@pytest.fixture
def port_base() -> int:
    return free_port_base()


@pytest.fixture
def kubelet(server, port_base, tmp_path) -> Iterator[FakeKubelet]:
    """Runs pods as processes; pods see the user's kubeconfig and a port base."""
    if server.real:
        plane = server.plane
        node_config = plane.node_kubeconfig
    else:
        node_config = write_kubeconfig(str(tmp_path / "kubelet.kubeconfig"), server.fake.url,
                                       "kubelet")
    api = config.new_client_from_config(config_file=node_config, persist_config=False)
    work = tmp_path / "node"
    work.mkdir()
    env = {"KUBECONFIG": server.kubeconfig, "ELASTICDL_K8S_PORT_BASE": str(port_base),
           "ELASTICDL_K8S_SERVICE_HOST": "127.0.0.1"}
    k = FakeKubelet(api, server.log_dir, str(work), extra_env=env, grace_s=1.0,
                    node=NODE if server.real else None,
                    namespaces={server.namespace} if server.real else None)
    if server.real and plane.kubelet_cert:
        k.serve_logs(plane.kubelet_port, *plane.kubelet_cert)
    yield k
    k.close()
    api.close()


@pytest.fixture(autouse=True)
def _no_in_cluster_env(monkeypatch) -> None:
    """Tests run outside a pod even where CI itself runs in one."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    for name in ("MY_POD_NAME", "MY_POD_IP", "ELASTICDL_K8S_SERVICE_HOST",
                 "ELASTICDL_K8S_PORT_BASE"):
        monkeypatch.delenv(name, raising=False)
