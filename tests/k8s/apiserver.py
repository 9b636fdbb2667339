"""A stand-in Kubernetes API server over HTTP on 127.0.0.1, for the official client.

Enough of ``/api/v1`` for ElasticDL and the test kubelet: pods (and their
``status`` subresource and ``log``) and services, namespaced; create, get,
list with label selectors, merge-patch, delete with owner-reference garbage
collection; ``resourceVersion`` on every change; watches streamed as chunked
JSON lines that resume from a ``resourceVersion`` (``410 Gone`` once
:meth:`FakeApiServer.compact` dropped the history). Test hooks:
:attr:`FakeApiServer.forbidden` (answer 403 but to the kubelet), :meth:`FakeApiServer.drop_watches`
(cut every open watch without ending the chunked stream).

Written rather than using ``kmock`` (an aiohttp-based mock) because these
tests need watch semantics (history, resume, 410, abrupt drops) spelled out.
Pod logs are files ``<log_dir>/<namespace>/<pod>.log`` written by the kubelet.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import parse_qs, urlparse

logger = logging.getLogger(__name__)

Obj = dict[str, Any]
KINDS = {"pods": "Pod", "services": "Service", "secrets": "Secret", "jobs": "Job"}
API_VERSIONS = {"jobs": "batch/v1"}
_GROUP = r"(?:/api/v1|/apis/batch/v1)"
_NAMED = re.compile(
    _GROUP + r"/namespaces/([^/]+)/(pods|services|secrets|jobs)/([^/]+)(/status|/log)?$")
_COLLECTION = re.compile(_GROUP + r"/(?:namespaces/([^/]+)/)?(pods|services|secrets|jobs)$")


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def status_body(code: int, reason: str, message: str) -> Obj:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _split_selector(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in parts + [cur] if p.strip()]


def matches(selector: str, labels: dict[str, str]) -> bool:
    """Label selector: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``, ``notin``."""
    for req in _split_selector(selector or ""):
        m = re.match(r"^([\w./-]+)\s+(in|notin)\s+\((.*)\)$", req)
        if m:
            values = {v.strip() for v in m.group(3).split(",")}
            if (labels.get(m.group(1)) in values) != (m.group(2) == "in"):
                return False
        elif "!=" in req:
            key, value = (s.strip() for s in req.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in req:
            key, value = (s.strip() for s in req.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif req.startswith("!"):
            if req[1:] in labels:
                return False
        elif req not in labels:
            return False
    return True


class FakeApiServer:
    """The store, history and HTTP server. Thread-safe; ``close()`` stops everything."""

    def __init__(self, log_dir: str, host: str = "127.0.0.1"):
        self.log_dir = log_dir
        self.forbidden = False  # 403 for every token but privileged_tokens (the kubelet's)
        self.privileged_tokens = {"kubelet"}
        self.requests: list[tuple[str, str]] = []
        self._cond = threading.Condition()
        self._objects: dict[tuple[str, str, str], Obj] = {}
        self._history: list[tuple[int, str, str, str, Obj]] = []  # rv, kind, ns, type, obj
        self._rv = 100
        self._floor = 0
        self._drop_gen = 0
        self._closing = False
        self._next_ip = 1
        self._sockets: set[socket.socket] = set()
        handler = type("Handler", (_Handler,), {"api": self})
        self._httpd = ThreadingHTTPServer((host, 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name="fake-apiserver", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    # ------------------------------------------------------------ test hooks
    def compact(self) -> None:
        """Forget the history: watches resuming from an older version get 410."""
        with self._cond:
            self._floor = self._rv
            self._history.clear()

    def drop_watches(self) -> None:
        """Cut every open watch connection abruptly (no final chunk)."""
        with self._cond:
            self._drop_gen += 1
            self._cond.notify_all()

    def get(self, kind: str, namespace: str, name: str) -> Optional[Obj]:
        with self._cond:
            obj = self._objects.get((kind, namespace, name))
            return copy.deepcopy(obj) if obj else None

    def list(self, kind: str, namespace: Optional[str] = None, selector: str = "") -> list[Obj]:
        with self._cond:
            return [copy.deepcopy(o) for (k, ns, _), o in sorted(self._objects.items())
                    if k == kind and namespace in (None, ns)
                    and matches(selector, o["metadata"].get("labels") or {})]

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            sockets = list(self._sockets)
        self._httpd.shutdown()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._httpd.server_close()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------ store
    def _record(self, kind: str, ns: str, type: str, obj: Obj) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._history.append((self._rv, kind, ns, type, copy.deepcopy(obj)))
        self._cond.notify_all()

    def create(self, kind: str, ns: str, body: Obj) -> tuple[int, Obj]:
        meta = body.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            return 422, status_body(422, "Invalid", "metadata.name: Required value")
        with self._cond:
            if (kind, ns, name) in self._objects:
                return 409, status_body(409, "AlreadyExists",
                                        f'{kind} "{name}" already exists')
            meta.update({"namespace": ns, "uid": str(uuid.uuid4()),
                         "creationTimestamp": now()})
            body.setdefault("apiVersion", API_VERSIONS.get(kind, "v1"))
            body["kind"] = KINDS[kind]
            if kind == "pods":
                body["status"] = {"phase": "Pending", "qosClass": "Burstable"}
            elif kind == "services":
                body.setdefault("spec", {})["clusterIP"] = f"10.96.0.{self._next_ip}"
                self._next_ip += 1
                body["status"] = {"loadBalancer": {}}
            elif kind == "jobs":
                body["status"] = {}
            self._objects[(kind, ns, name)] = body
            self._record(kind, ns, "ADDED", body)
            return 201, copy.deepcopy(body)

    def patch(self, kind: str, ns: str, name: str, patch: Obj, status_only: bool,
              replace: bool = False) -> tuple[int, Obj]:
        with self._cond:
            obj = self._objects.get((kind, ns, name))
            if obj is None:
                return 404, status_body(404, "NotFound", f'{kind} "{name}" not found')
            if status_only:
                new_status = patch.get("status", {})
                obj["status"] = (copy.deepcopy(new_status) if replace
                                 else merge_patch(obj.get("status", {}), new_status))
            else:
                for key in ("metadata", "spec"):
                    if key in patch:
                        obj[key] = merge_patch(obj[key], patch[key])
                obj["metadata"].update(name=name, namespace=ns)
            self._record(kind, ns, "MODIFIED", obj)
            return 200, copy.deepcopy(obj)

    def delete(self, kind: str, ns: str, name: str) -> tuple[int, Obj]:
        with self._cond:
            obj = self._objects.pop((kind, ns, name), None)
            if obj is None:
                return 404, status_body(404, "NotFound", f'{kind} "{name}" not found')
            obj["metadata"]["deletionTimestamp"] = now()
            self._record(kind, ns, "DELETED", obj)
            self._collect_garbage(obj["metadata"]["uid"])
            return 200, copy.deepcopy(obj)

    def _collect_garbage(self, owner_uid: str) -> None:
        """Background propagation: delete what the deleted object owned, recursively."""
        for (kind, ns, name), obj in list(self._objects.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if any(r.get("uid") == owner_uid for r in refs):
                self.delete(kind, ns, name)

    def events_after(self, rv: int, kind: str, ns: Optional[str],
                     selector: str) -> list[tuple[int, str, Obj]]:
        return [(v, t, o) for v, k, n, t, o in self._history
                if v > rv and k == kind and ns in (None, n)
                and matches(selector, o["metadata"].get("labels") or {})]


class _Handler(BaseHTTPRequestHandler):
    api: FakeApiServer
    protocol_version = "HTTP/1.1"
    timeout = 30

    def setup(self) -> None:
        super().setup()
        with self.api._cond:
            self.api._sockets.add(self.connection)

    def finish(self) -> None:
        with self.api._cond:
            self.api._sockets.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    # ------------------------------------------------------------ plumbing
    def _send(self, code: int, body: Obj) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Obj:
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else b"{}"
        return json.loads(data or b"{}")

    def _route(self, method: str) -> None:
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self.api.requests.append((method, self.path))
        token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        if self.api.forbidden and token not in self.api.privileged_tokens:
            self._send(403, status_body(403, "Forbidden", f'{method} {url.path} is forbidden: '
                                        'User "system:serviceaccount:default:elasticdl" '
                                        "cannot do this"))
            return
        named = _NAMED.match(url.path)
        coll = _COLLECTION.match(url.path)
        if named:
            ns, kind, name, sub = named.groups()
            if sub == "/log" and kind == "pods" and method == "GET":
                self._log(ns, name, query)
            elif method == "GET":
                obj = self.api.get(kind, ns, name)
                self._send(200, obj) if obj else self._send(
                    404, status_body(404, "NotFound", f'{kind} "{name}" not found'))
            elif method in ("PATCH", "PUT"):
                if "json-patch" in (self.headers.get("Content-Type") or ""):
                    self._send(415, status_body(415, "UnsupportedMediaType", "json-patch"))
                    return
                self._send(*self.api.patch(kind, ns, name, self._body(), sub == "/status",
                                           replace=method == "PUT"))
            elif method == "DELETE":
                self._body()
                self._send(*self.api.delete(kind, ns, name))
            else:
                self._send(405, status_body(405, "MethodNotAllowed", method))
        elif coll:
            ns, kind = coll.groups()
            if method == "POST" and ns:
                self._send(*self.api.create(kind, ns, self._body()))
            elif method == "GET" and query.get("watch", "").lower() in ("true", "1"):
                self._watch(kind, ns, query)
            elif method == "GET":
                with self.api._cond:
                    items = self.api.list(kind, ns, query.get("labelSelector", ""))
                    rv = str(self.api._rv)
                self._send(200, {"kind": KINDS[kind] + "List", "apiVersion": "v1",
                                 "metadata": {"resourceVersion": rv}, "items": items})
            else:
                self._send(405, status_body(405, "MethodNotAllowed", method))
        else:
            self._send(404, status_body(404, "NotFound", f"no route {url.path}"))

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PATCH(self) -> None:
        self._route("PATCH")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    # ------------------------------------------------------------ streaming
    def _start_chunked(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _watch(self, kind: str, ns: Optional[str], query: dict[str, str]) -> None:
        api, selector = self.api, query.get("labelSelector", "")
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        rv_text = query.get("resourceVersion", "")
        with api._cond:
            drop_gen = api._drop_gen
            if rv_text and rv_text != "0" and int(rv_text) < api._floor:
                pending: list[Obj] = [{"type": "ERROR", "object": status_body(
                    410, "Expired", f"too old resource version: {rv_text} ({api._floor})")}]
                position = -1
            elif rv_text and rv_text != "0":
                position, pending = int(rv_text), []
            else:  # no version: the current state as ADDED, then changes
                pending = [{"type": "ADDED", "object": o} for o in api.list(kind, ns, selector)]
                position = api._rv
        self._start_chunked()
        try:
            while True:
                for event in pending:
                    self._chunk(json.dumps(event).encode() + b"\n")
                if position < 0:
                    break
                with api._cond:
                    api._cond.wait_for(lambda pos=position: api._closing  # type: ignore[misc]
                                       or api._drop_gen != drop_gen or api._rv > pos,
                                       timeout=0.2)
                    if api._drop_gen != drop_gen or api._closing:
                        self.connection.shutdown(socket.SHUT_RDWR)
                        self.close_connection = True
                        return
                    found = api.events_after(position, kind, ns, selector)
                    position = api._rv
                pending = [{"type": t, "object": o} for _, t, o in found]
                if time.monotonic() > deadline:
                    break
            self._chunk(b"")  # zero-length chunk ends a watch cleanly
        except OSError:
            self.close_connection = True

    def _log(self, ns: str, name: str, query: dict[str, str]) -> None:
        pod = self.api.get("pods", ns, name)
        if pod is None:
            self._send(404, status_body(404, "NotFound", f'pods "{name}" not found'))
            return
        path = os.path.join(self.api.log_dir, ns, f"{name}.log")
        if not os.path.exists(path):
            self._send(400, status_body(400, "BadRequest", f'container "{name}" in pod '
                                        f'"{name}" is waiting to start: ContainerCreating'))
            return
        with open(path, "rb") as f:
            data = f.read()
        if query.get("tailLines"):
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-int(query["tailLines"]):]) if int(query["tailLines"]) else b""
        if query.get("follow", "").lower() not in ("true", "1"):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self._follow(ns, name, path, data)

    def _follow(self, ns: str, name: str, path: str, first: bytes) -> None:
        self._start_chunked()
        offset = os.path.getsize(path)
        deadline = time.monotonic() + 300
        try:
            if first:
                self._chunk(first)
            while time.monotonic() < deadline and not self.api._closing:
                pod = self.api.get("pods", ns, name)  # before reading: no line is lost
                done = pod is None or pod["status"].get("phase") in ("Succeeded", "Failed")
                with open(path, "rb") as f:
                    f.seek(offset)
                    more = f.read()
                offset += len(more)
                if more:
                    self._chunk(more)
                elif done:
                    break
                else:
                    time.sleep(0.05)
            self._chunk(b"")
        except OSError:
            self.close_connection = True
