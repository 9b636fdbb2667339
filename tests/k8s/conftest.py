"""Fixtures: a stand-in API server, kubeconfigs pointing at it, a test kubelet.

Nothing here needs a cluster, Docker or the network beyond 127.0.0.1.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

pytest.importorskip("kubernetes")

from kubernetes import client, config  # noqa: E402

from tests.k8s.apiserver import FakeApiServer  # noqa: E402
from tests.k8s.kubelet import FakeKubelet  # noqa: E402

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
    """A port base P such that the master (P), PS 0-3 (P+1..P+4) and workers 0-7
    (P+1001..P+1008) ports were free a moment ago."""
    for base in range(41000, 59000, 1500):
        probe = [base + i for i in range(5)] + [base + 1001 + i for i in range(8)]
        try:
            for port in probe:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range found on 127.0.0.1")


@pytest.fixture
def apiserver(tmp_path) -> Iterator[FakeApiServer]:
    server = FakeApiServer(str(tmp_path / "pod-logs"))
    yield server
    server.close()


@pytest.fixture
def kubeconfig(apiserver, tmp_path) -> str:
    """The user's kubeconfig (token ``user``)."""
    return write_kubeconfig(str(tmp_path / "kubeconfig"), apiserver.url, "user")


@pytest.fixture
def api_client(kubeconfig) -> Iterator[client.ApiClient]:
    api = config.new_client_from_config(config_file=kubeconfig, persist_config=False)
    yield api
    api.close()


@pytest.fixture
def port_base() -> int:
    return free_port_base()


@pytest.fixture
def kubelet(apiserver, kubeconfig, port_base, tmp_path) -> Iterator[FakeKubelet]:
    """Runs pods as processes; pods see the user's kubeconfig and a port base."""
    kubelet_config = write_kubeconfig(str(tmp_path / "kubelet.kubeconfig"), apiserver.url,
                                      "kubelet")
    api = config.new_client_from_config(config_file=kubelet_config, persist_config=False)
    work = tmp_path / "node"
    work.mkdir()
    env = {"KUBECONFIG": kubeconfig, "ELASTICDL_K8S_PORT_BASE": str(port_base),
           "ELASTICDL_K8S_SERVICE_HOST": "127.0.0.1"}
    k = FakeKubelet(api, apiserver.log_dir, str(work), extra_env=env, grace_s=1.0)
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
