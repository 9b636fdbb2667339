"""A test kubelet: runs each pod's container command as a local process.

It watches all pods through the API (the official client, like a real
kubelet), starts a process for each new pod (``python`` -> this interpreter;
env from the container spec, downward-API fields resolved: ``MY_POD_IP`` is
127.0.0.1, ``MY_POD_NAME`` the pod name; plus ``extra_env``, as a kubelet adds
its own variables), writes its stdout+stderr to ``<log_dir>/<ns>/<pod>.log``
(served by the stand-in's log endpoint) and reports phases back through the
``status`` subresource: Running, then Succeeded/Failed with a terminated
container state (exit code, reason ``Completed``/``Error``/``OOMKilled``;
death by signal N is exit 128+N as with containerd). A deleted pod's process
gets SIGTERM, then SIGKILL after ``grace_s``; the API server's garbage
collector deletes owned pods, so deleting a master pod stops the whole job.
:meth:`FakeKubelet.oom_kill` and :meth:`FakeKubelet.evict` fake the kernel's
OOM killer and node-pressure eviction.

Against a genuine API server (``node=`` set) it behaves as that node's
kubelet: it runs only the pods the scheduler bound to it, reports their status
as the node (Node authorizer, NodeRestriction), ends a pod whose
``deletionTimestamp`` is set and then confirms the deletion with grace 0 (the
server keeps the pod Terminating until then), and :meth:`serve_logs` answers
the API server's ``pods/log`` requests over TLS.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO, Any, Optional

import urllib3
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

logger = logging.getLogger(__name__)

NODE = "fake-node"
POD_IP = "127.0.0.1"


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class _Proc:
    ns: str
    name: str
    uid: str
    container: str
    image: str
    proc: subprocess.Popen
    log: IO[bytes]
    started: str
    oom: bool = False
    evicted: bool = False
    deleted: bool = False
    kill_at: Optional[float] = None
    reported: bool = False


class FakeKubelet:
    """One node: every pod of the stand-in, or the pods bound to ``node``."""

    def __init__(self, api_client: client.ApiClient, log_dir: str, work_dir: str,
                 extra_env: Optional[dict[str, str]] = None, grace_s: float = 2.0,
                 poll_s: float = 0.05, node: Optional[str] = None,
                 namespaces: Optional[set[str]] = None):
        """``node``: run only pods the scheduler bound to it (a real control plane;
        the stand-in has no scheduler); ``namespaces``: ignore pods elsewhere."""
        self._core = client.CoreV1Api(api_client)
        self.node = node
        self.namespaces = namespaces
        self.log_dir = log_dir
        self.work_dir = work_dir
        self.extra_env = dict(extra_env or {})
        self.pod_home = False   # True: ELASTICDL_HOME of each pod its own (no shared disk)
        self.unset_env: set[str] = set()   # not passed on to pods (e.g. credentials)
        self.grace_s = grace_s
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._procs: dict[str, _Proc] = {}  # by pod uid
        self._seen: set[str] = set()
        self._confirm: set[tuple[str, str, str]] = set()  # deleted pods to remove for good
        self._stop = threading.Event()
        self._watch: Optional[watch.Watch] = None
        self._log_server: Optional[ThreadingHTTPServer] = None
        self._threads = [threading.Thread(target=self._watch_loop, name="kubelet-watch",
                                          daemon=True),
                         threading.Thread(target=self._reap_loop, name="kubelet-reap",
                                          daemon=True)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------ test hooks
    def pid(self, ns: str, name: str, timeout_s: float = 10.0) -> int:
        """The pid of a pod's process, waiting for it to start."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                for p in self._procs.values():
                    if (p.ns, p.name) == (ns, name):
                        return p.proc.pid
            time.sleep(0.02)
        raise TimeoutError(f"pod {ns}/{name} did not start within {timeout_s} s")

    def kill(self, ns: str, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the pod's process group (``kill -9`` from outside)."""
        self._signal(self._find(ns, name), sig)

    def oom_kill(self, ns: str, name: str) -> None:
        """SIGKILL reported as ``OOMKilled``, as when the memory limit is hit."""
        p = self._find(ns, name)
        p.oom = True
        self._signal(p, signal.SIGKILL)

    def evict(self, ns: str, name: str) -> None:
        """Node-pressure eviction: kill, then phase Failed with reason Evicted."""
        p = self._find(ns, name)
        p.evicted = True
        self._signal(p, signal.SIGKILL)

    def serve_logs(self, port: int, certfile: str, keyfile: str) -> None:
        """Serve ``/containerLogs/<ns>/<pod>/<container>`` over TLS, as a kubelet does
        for a real API server's ``pods/log`` (``tailLines``, ``follow``)."""
        kubelet = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("kubelet log server: " + format, *args)

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                parts = url.path.strip("/").split("/")
                query = dict(urllib.parse.parse_qsl(url.query))
                if len(parts) != 4 or parts[0] != "containerLogs":
                    self.send_error(404)
                    return
                path = os.path.join(kubelet.log_dir, parts[1], f"{parts[2]}.log")
                if not os.path.exists(path):
                    self.send_error(404, f"no log of {parts[1]}/{parts[2]}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Connection", "close")
                self.end_headers()
                with open(path, "rb") as f:
                    data = f.read()
                    if "tailLines" in query:
                        n = int(query["tailLines"])
                        lines = data.splitlines(keepends=True)
                        data = b"".join(lines[-n:]) if n > 0 else b""
                    self.wfile.write(data)
                    while query.get("follow") == "true" and not kubelet._stop.is_set():
                        alive = any((p.ns, p.name) == (parts[1], parts[2])
                                    for p in kubelet._procs_snapshot())
                        chunk = f.read()
                        if chunk:
                            self.wfile.write(chunk)
                            self.wfile.flush()
                        elif not alive:
                            break
                        else:
                            time.sleep(0.1)

        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        server.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(certfile, keyfile)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        self._log_server = server
        threading.Thread(target=server.serve_forever, name="kubelet-logs", daemon=True).start()

    def _procs_snapshot(self) -> list[_Proc]:
        with self._lock:
            return list(self._procs.values())

    def running(self) -> list[str]:
        with self._lock:
            return sorted(p.name for p in self._procs.values() if p.proc.poll() is None)

    def close(self) -> None:
        """Stop watching; SIGTERM then SIGKILL every process; join the threads."""
        self._stop.set()
        deadline = time.monotonic() + 10
        while self._threads[0].is_alive() and time.monotonic() < deadline:
            if self._watch is not None:  # stop() only cuts a stream that has begun
                self._watch.stop()
            self._threads[0].join(timeout=0.05)
        with self._lock:
            procs = list(self._procs.values())
        for p in procs:
            self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for p in procs:
            try:
                p.proc.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(p, signal.SIGKILL)
                p.proc.wait(timeout=10)
            p.log.close()
        for t in self._threads:
            t.join(timeout=15)
        if self._log_server is not None:
            self._log_server.shutdown()
            self._log_server.server_close()

    # ------------------------------------------------------------ internals
    def _find(self, ns: str, name: str) -> _Proc:
        with self._lock:
            for p in self._procs.values():
                if (p.ns, p.name) == (ns, name):
                    return p
        raise KeyError(f"no process for pod {ns}/{name}")

    @staticmethod
    def _signal(p: _Proc, sig: int) -> None:
        try:
            os.killpg(p.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _watch_loop(self) -> None:
        rv = ""
        while not self._stop.is_set():
            try:
                if not rv:
                    resp = self._core.list_pod_for_all_namespaces(_preload_content=False,
                                                                  _request_timeout=(5, 30))
                    raw = json.loads(resp.data)
                    resp.release_conn()
                    for pod in raw["items"]:
                        self._on_pod("ADDED", pod)
                    rv = raw["metadata"]["resourceVersion"]
                self._watch = w = watch.Watch(return_type="object")
                for event in w.stream(self._core.list_pod_for_all_namespaces,
                                      resource_version=rv, timeout_seconds=5,
                                      _request_timeout=(5, 15)):
                    pod = event["raw_object"]
                    rv = pod["metadata"]["resourceVersion"]
                    self._on_pod(event["type"], pod)
                    if self._stop.is_set():
                        break
            except (ApiException, urllib3.exceptions.HTTPError) as e:
                if isinstance(e, ApiException) and e.status == 410:
                    rv = ""
                elif not self._stop.is_set():
                    logger.debug("kubelet watch interrupted: %s", e)
                    self._stop.wait(0.1)

    def _on_pod(self, type: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        if self.namespaces is not None and meta["namespace"] not in self.namespaces:
            return
        bound = self.node is None or (pod.get("spec") or {}).get("nodeName") == self.node
        if type == "DELETED" or (meta.get("deletionTimestamp") and bound):
            with self._lock:
                p = self._procs.get(uid)
                if p is None and type != "DELETED" and self.node is not None:
                    self._confirm.add((meta["namespace"], meta["name"], uid))
            if p is not None and p.proc.poll() is None and not p.deleted:
                p.deleted = True
                p.kill_at = time.monotonic() + self.grace_s
                self._signal(p, signal.SIGTERM)
            elif p is not None:
                p.deleted = True
            return
        if not bound:
            return
        with self._lock:
            if uid in self._seen or pod["status"].get("phase") not in (None, "Pending"):
                return
            self._seen.add(uid)
        self._start(pod)

    def _env(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        meta = pod["metadata"]
        fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                  "metadata.uid": meta["uid"], "status.podIP": POD_IP,
                  "status.hostIP": POD_IP, "spec.nodeName": NODE}
        env = dict(os.environ)
        env.update(self.extra_env)
        for name in self.unset_env:
            env.pop(name, None)
        env["PYTHONUNBUFFERED"] = "1"
        if self.pod_home:   # every pod its own disk, as containers have
            env["ELASTICDL_HOME"] = os.path.join(self.work_dir, "homes",
                                                 f"{meta['name']}-{meta['uid'][:8]}")
        for source in container.get("envFrom") or []:   # before env, which overrides it
            ref = source.get("secretRef")
            if ref:
                env.update(self._secret_all(meta["namespace"], ref))
        for item in container.get("env") or []:
            source = item.get("valueFrom") or {}
            ref = (source.get("fieldRef") or {}).get("fieldPath")
            if source.get("secretKeyRef"):
                value = self._secret_value(meta["namespace"], source["secretKeyRef"])
                if value is not None:  # None: an optional ref to an absent Secret/key
                    env[item["name"]] = value
            else:
                env[item["name"]] = fields.get(ref, "") if ref else str(item.get("value", ""))
        return env

    def _read_secret(self, ns: str, ref: dict[str, Any]) -> Optional[Any]:
        """The Secret a ``secretKeyRef``/``secretRef`` names, as the real kubelet reads it
        (OSError: the pod cannot start; None: ``optional`` and the Secret is absent)."""
        # A real kubelet retries (CreateContainerConfigError) until the Secret can be
        # read: the Node authorizer learns of a newly bound pod's secrets a moment
        # after the binding, so the first read may be refused.
        deadline = time.monotonic() + 15
        while True:
            try:
                return self._core.read_namespaced_secret(ref["name"], ns)
            except client.ApiException as e:
                if e.status == 404 and ref.get("optional"):
                    return None
                if e.status not in (403, 404) or time.monotonic() > deadline:
                    raise OSError(f"secret {ref['name']!r}: {e.reason}") from None
                time.sleep(0.2)

    def _secret_all(self, ns: str, ref: dict[str, Any]) -> dict[str, str]:
        """Every key of a Secret (``envFrom``/``secretRef``)."""
        secret = self._read_secret(ns, ref)
        data = (secret.data or {}) if secret is not None else {}
        return {k: base64.b64decode(v).decode() for k, v in data.items()}

    def _secret_value(self, ns: str, ref: dict[str, Any]) -> Optional[str]:
        """A ``secretKeyRef`` (None: ``optional`` and the Secret or key is absent)."""
        secret = self._read_secret(ns, ref)
        value = (secret.data or {}).get(ref["key"]) if secret is not None else None
        if value is None and ref.get("optional"):
            return None
        if value is None:
            raise OSError(f"secret {ref['name']!r} has no key {ref['key']!r}")
        return base64.b64decode(value).decode()

    def _start(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        ns, name = meta["namespace"], meta["name"]
        container = pod["spec"]["containers"][0]
        argv = list(container.get("command") or []) + list(container.get("args") or [])
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        os.makedirs(os.path.join(self.log_dir, ns), exist_ok=True)
        log = open(os.path.join(self.log_dir, ns, f"{name}.log"), "ab")
        started = now()
        try:
            if not argv:
                raise OSError("the container has no command (images are not run here)")
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self._env(pod, container),
                                    cwd=container.get("workingDir") or self.work_dir,
                                    start_new_session=True)
        except OSError as e:
            log.write(f"kubelet: cannot start: {e}\n".encode())
            log.close()
            self._report(ns, name, {"phase": "Failed", "message": str(e), "containerStatuses": [
                self._container_status(container, {"terminated": {
                    "exitCode": 128, "reason": "StartError", "message": str(e),
                    "startedAt": started, "finishedAt": now()}})]})
            return
        logger.debug("started pod %s/%s as pid %d", ns, name, proc.pid)
        record = _Proc(ns, name, meta["uid"], container["name"], container.get("image", ""),
                       proc, log, started)
        with self._lock:  # findable by the test hooks once the API says Running
            self._procs[meta["uid"]] = record
        self._report(ns, name, {
            "phase": "Running", "podIP": POD_IP, "podIPs": [{"ip": POD_IP}],
            "hostIP": POD_IP, "startTime": started,
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": started}],
            "containerStatuses": [self._container_status(
                container, {"running": {"startedAt": started}}, ready=True)]})
        record.reported = True  # only now may the reaper report the end

    @staticmethod
    def _container_status(container: dict[str, Any], state: dict[str, Any],
                          ready: bool = False) -> dict[str, Any]:
        return {"name": container["name"], "image": container.get("image", ""),
                "imageID": "", "ready": ready, "restartCount": 0, "started": ready,
                "state": state}

    def _report(self, ns: str, name: str, status: dict[str, Any]) -> None:
        try:
            self._core.patch_namespaced_pod_status(name, ns, {"status": status},
                                                   _request_timeout=(5, 10))
        except ApiException as e:
            if e.status != 404:  # a deleted pod has no status to report
                raise

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                procs = list(self._procs.values())
            for p in procs:
                code = p.proc.poll() if p.reported else None
                if code is None:
                    if p.kill_at is not None and time.monotonic() > p.kill_at:
                        self._signal(p, signal.SIGKILL)
                    continue
                with self._lock:
                    self._procs.pop(p.uid, None)
                p.log.close()
                if not p.deleted:
                    self._finished(p, code)
                elif self.node is not None:
                    with self._lock:
                        self._confirm.add((p.ns, p.name, p.uid))
            with self._lock:
                confirm, self._confirm = self._confirm, set()
            for ns, name, uid in confirm:
                self._confirm_deleted(ns, name, uid)

    def _confirm_deleted(self, ns: str, name: str, uid: str) -> None:
        """What a kubelet does once a deleted pod's containers are gone: delete it with
        grace 0 (a real API server keeps it Terminating until then)."""
        try:
            self._core.delete_namespaced_pod(
                name, ns, grace_period_seconds=0, _preload_content=False,
                body=client.V1DeleteOptions(grace_period_seconds=0,
                                            preconditions=client.V1Preconditions(uid=uid)),
                _request_timeout=(5, 10))
        except ApiException as e:
            if e.status not in (404, 409):  # gone already / a new pod of that name
                logger.warning("kubelet could not remove %s/%s: %s", ns, name, e.reason)
        except urllib3.exceptions.HTTPError as e:
            logger.warning("kubelet could not remove %s/%s: %s", ns, name, e)

    def _finished(self, p: _Proc, code: int) -> None:
        exit_code = code if code >= 0 else 128 - code
        reason = "OOMKilled" if p.oom else ("Completed" if code == 0 else "Error")
        terminated = {"exitCode": exit_code, "reason": reason, "startedAt": p.started,
                      "finishedAt": now()}
        if code < 0:
            terminated["signal"] = -code
        status: dict[str, Any] = {
            "phase": "Succeeded" if code == 0 else "Failed",
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now()}],
            "containerStatuses": [self._container_status(
                {"name": p.container, "image": p.image}, {"terminated": terminated})]}
        if p.evicted:
            status.update(reason="Evicted", message="The node was low on resource: memory.")
        logger.debug("pod %s/%s exited with %d (%s)", p.ns, p.name, exit_code, reason)
        try:
            self._report(p.ns, p.name, status)
        except (ApiException, urllib3.exceptions.HTTPError) as e:
            logger.warning("kubelet could not report %s/%s: %s", p.ns, p.name, e)
