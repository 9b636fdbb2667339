"""Per-job secrets on the wire: a token every master/PS call carries, optional TLS.

A job has one :class:`JobSecrets`: a random token (and, with ``--grpc_tls``, a
self-signed certificate and its key). The launcher generates it once per job and
hands it to every replica: locally through the environment of child processes
(and files of mode 0600 under ``<job_dir>/secrets``), on Kubernetes through a
``Secret`` owned by the master pod that replica pods reference by env (see
docs/security.md).

Servers (master, PS) install :class:`TokenInterceptor`: a call without the token
in its metadata (``x-elasticdl-token``) is answered ``UNAUTHENTICATED`` before
any handler runs or any request message is parsed. Clients get a channel from
:func:`client_channel` that attaches the token (and the caller's replica name,
``x-elasticdl-replica``) to every call, so call sites do not change.
"""

from __future__ import annotations

import base64
import hmac
import logging
import os
import secrets as _secrets
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import grpc

logger = logging.getLogger(__name__)

TOKEN_ENV = "ELASTICDL_JOB_TOKEN"
TLS_CERT_ENV = "ELASTICDL_GRPC_TLS_CERT"  # PEM text
TLS_KEY_ENV = "ELASTICDL_GRPC_TLS_KEY"
TOKEN_HEADER = "x-elasticdl-token"
REPLICA_HEADER = "x-elasticdl-replica"
# The self-signed certificate names this host; clients pin the certificate and
# override the name they check, so pod IPs and Service names need no SAN each.
TLS_SERVER_NAME = "elasticdl-job"
SECRETS_DIR = "secrets"
# Secret keys (also the file names under <job_dir>/secrets).
TOKEN_KEY, CERT_KEY, KEY_KEY = "token", "tls.crt", "tls.key"
MIN_TOKEN_CHARS = 16


class AuthError(RuntimeError):
    """Job secrets cannot be created or read."""


@dataclass(frozen=True)
class JobSecrets:
    """The job's token and optional TLS certificate/key (PEM)."""

    token: str
    tls_cert: bytes = b""
    tls_key: bytes = b""

    def __post_init__(self) -> None:
        if len(self.token) < MIN_TOKEN_CHARS:
            raise AuthError(f"job token too short ({len(self.token)} chars, need "
                            f">= {MIN_TOKEN_CHARS})")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise AuthError("TLS needs both a certificate and a key")

    def __repr__(self) -> str:  # never log the token
        return f"JobSecrets(token=<{len(self.token)} chars>, tls={self.tls})"

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> Optional[JobSecrets]:
        """The secrets in ``env`` (default ``os.environ``); None when no token is set."""
        env = os.environ if env is None else env
        token = env.get(TOKEN_ENV, "")
        if not token:
            return None
        return cls(token, env.get(TLS_CERT_ENV, "").encode(), env.get(TLS_KEY_ENV, "").encode())

    def env(self) -> dict[str, str]:
        """Environment variables that carry these secrets to a child process."""
        out = {TOKEN_ENV: self.token}
        if self.tls:
            out[TLS_CERT_ENV] = self.tls_cert.decode()
            out[TLS_KEY_ENV] = self.tls_key.decode()
        return out

    def data(self) -> dict[str, str]:
        """Base64 ``data`` of a Kubernetes Secret."""
        raw = {TOKEN_KEY: self.token.encode()}
        if self.tls:
            raw.update({CERT_KEY: self.tls_cert, KEY_KEY: self.tls_key})
        return {k: base64.b64encode(v).decode() for k, v in raw.items()}


def generate_token() -> str:
    """256 random bits, URL-safe text."""
    return _secrets.token_urlsafe(32)


def self_signed_cert(days: int = 365) -> tuple[bytes, bytes]:
    """``(cert_pem, key_pem)`` for :data:`TLS_SERVER_NAME` (the ``openssl`` CLI;
    the ``cryptography`` package is not a dependency). Raises AuthError."""
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = os.path.join(tmp, "c.pem"), os.path.join(tmp, "k.pem")
        cmd = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
               "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key, "-out", cert,
               "-days", str(days), "-subj", f"/CN={TLS_SERVER_NAME}",
               "-addext", f"subjectAltName=DNS:{TLS_SERVER_NAME}"]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            raise AuthError(f"cannot create a TLS certificate with openssl: {e}") from e
        with open(cert, "rb") as f, open(key, "rb") as g:
            return f.read(), g.read()


def generate(tls: bool = False) -> JobSecrets:
    cert, key = self_signed_cert() if tls else (b"", b"")
    return JobSecrets(generate_token(), cert, key)


def _write_private(path: str, content: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(content)
    os.chmod(path, 0o600)  # an existing file keeps its mode on O_CREAT


def write_job_secrets(job_dir: str, job_secrets: JobSecrets) -> str:
    """Store the secrets under ``<job_dir>/secrets`` (dir 0700, files 0600)."""
    path = os.path.join(job_dir, SECRETS_DIR)
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    _write_private(os.path.join(path, TOKEN_KEY), job_secrets.token.encode())
    for name, content in ((CERT_KEY, job_secrets.tls_cert), (KEY_KEY, job_secrets.tls_key)):
        target = os.path.join(path, name)
        if content:
            _write_private(target, content)
        elif os.path.exists(target):
            os.unlink(target)
    return path


def read_job_secrets(job_dir: str) -> Optional[JobSecrets]:
    """The secrets stored under ``<job_dir>/secrets``; None when there are none."""
    path = os.path.join(job_dir, SECRETS_DIR)

    def read(name: str) -> bytes:
        try:
            with open(os.path.join(path, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return b""

    token = read(TOKEN_KEY).decode().strip()
    return JobSecrets(token, read(CERT_KEY), read(KEY_KEY)) if token else None


def ensure_job_secrets(job_dir: str, tls: bool) -> JobSecrets:
    """The job's secrets: from the environment, else ``<job_dir>/secrets``, else new
    ones written there. With ``tls`` a secret set without a certificate gets one."""
    found = JobSecrets.from_env() or read_job_secrets(job_dir)
    if found is not None and (found.tls or not tls):
        return found
    fresh = generate(tls)
    if found is not None:
        fresh = JobSecrets(found.token, fresh.tls_cert, fresh.tls_key)
    write_job_secrets(job_dir, fresh)
    return fresh


# ------------------------------------------------------------------ server side
_FACTORIES: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def metadata_value(metadata: Optional[Sequence[Any]], key: str) -> Optional[str]:
    for item in metadata or ():
        if item[0] == key:
            value = item[1]
            return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return None


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call whose metadata lacks the job token.

    The refusal handler has the call's own cardinality and takes the request as
    raw bytes, so nothing from an unauthenticated caller is parsed.
    """

    def __init__(self, token: str, log_every_s: float = 10.0):
        self._token = token.encode()
        self._log_every_s = log_every_s
        self._log_lock = threading.Lock()
        self._last_log = -log_every_s
        self._refused = 0

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        given = metadata_value(handler_call_details.invocation_metadata, TOKEN_HEADER)
        if given is not None and hmac.compare_digest(given.encode(), self._token):
            return handler
        method = handler_call_details.method
        reason = "no job token" if given is None else "wrong job token"
        self._log_refusal(method, reason)

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"{method}: {reason} ({TOKEN_HEADER} metadata); only the job's "
                          "own replicas may call this server")

        factory = _FACTORIES[(handler.request_streaming, handler.response_streaming)]
        return factory(refuse)


    def _log_refusal(self, method: str, reason: str) -> None:
        """At most one warning per ``log_every_s`` (a flood must not fill the log)."""
        with self._log_lock:
            self._refused += 1
            now = time.monotonic()
            if now - self._last_log < self._log_every_s:
                return
            self._last_log, count, self._refused = now, self._refused, 0
        logger.warning("refused %s: %s (%d call(s) refused since the last warning)", method,
                       reason, count)


def server_interceptors(job_secrets: Optional[JobSecrets]) -> list[grpc.ServerInterceptor]:
    return [TokenInterceptor(job_secrets.token)] if job_secrets is not None else []


def add_port(server: grpc.Server, address: str, job_secrets: Optional[JobSecrets]) -> int:
    """Bind ``address``: TLS when the secrets hold a certificate. Returns the port (0: failed)."""
    if job_secrets is not None and job_secrets.tls:
        creds = grpc.ssl_server_credentials([(job_secrets.tls_key, job_secrets.tls_cert)])
        return server.add_secure_port(address, creds)
    return server.add_insecure_port(address)


# ------------------------------------------------------------------ client side
class _Details(NamedTuple):
    method: str
    timeout: Optional[float]
    metadata: Optional[Sequence[tuple[str, str]]]
    credentials: Optional[grpc.CallCredentials]
    wait_for_ready: Optional[bool]
    compression: Any


class MetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                          grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata (the token, the replica name) to every call."""

    def __init__(self, metadata: Sequence[tuple[str, str]]):
        self._metadata = tuple(metadata)

    def _details(self, d: Any) -> _Details:
        return _Details(d.method, d.timeout, tuple(d.metadata or ()) + self._metadata,
                        d.credentials, getattr(d, "wait_for_ready", None),
                        getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)


def client_channel(target: str, options: Sequence[tuple[str, Any]] = (),
                   job_secrets: Optional[JobSecrets] = None, replica: str = "") -> grpc.Channel:
    """A channel to a master or PS of this job.

    ``job_secrets`` defaults to :meth:`JobSecrets.from_env`; without secrets the
    channel is plain (a server with a token will refuse it). With TLS the server
    must present the job's certificate (pinned as the only root).
    """
    job_secrets = job_secrets if job_secrets is not None else JobSecrets.from_env()
    opts = list(options)
    if job_secrets is None:
        return grpc.insecure_channel(target, options=opts)
    if job_secrets.tls:
        opts.append(("grpc.ssl_target_name_override", TLS_SERVER_NAME))
        creds = grpc.ssl_channel_credentials(root_certificates=job_secrets.tls_cert)
        channel = grpc.secure_channel(target, creds, options=opts)
    else:
        channel = grpc.insecure_channel(target, options=opts)
    metadata = [(TOKEN_HEADER, job_secrets.token)]
    if replica:
        metadata.append((REPLICA_HEADER, replica))
    return grpc.intercept_channel(channel, MetadataInterceptor(metadata))


def caller_replica(context: Any) -> Optional[str]:
    """The replica name the caller's channel declared (``worker-3``), if any."""
    try:
        metadata = context.invocation_metadata()
    except AttributeError:
        return None
    return metadata_value(metadata, REPLICA_HEADER)


def describe(job_secrets: Optional[JobSecrets]) -> str:
    """For logs: what protects a server."""
    if job_secrets is None:
        return "NO authentication: any client that reaches the port is served"
    return "job token + TLS" if job_secrets.tls else "job token, plaintext"
