"""Building and starting the PS gRPC server."""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Optional

import grpc

from elasticdl.common import auth, chunk_wire, rpc_service
from elasticdl.common.wire import GRPC_OPTIONS
from elasticdl.ps.servicer import PServicer

logger = logging.getLogger(__name__)



# The bulk stream is parsed without protobuf copies (same wire format; see chunk_wire).
_REQUEST_PARSERS = {"push_gradient_chunks": chunk_wire.parse_gradient_chunk_or_error}


def add_pserver(servicer: PServicer, server: grpc.Server) -> None:
    """Register every PServer method of ``servicer``: generated message classes for
    requests (a malformed one reaches the servicer as ``Malformed``), except the bulk
    push stream; responses may be pre-serialised bytes."""
    rpc_service.add_service(servicer, server, "PServer", _REQUEST_PARSERS,
                            chunk_wire.serialize)


def build_server(servicer: PServicer, port: int = 0, host: str = "0.0.0.0",
                 max_workers: int = 64, job_secrets: Optional[auth.JobSecrets] = None
                 ) -> tuple[grpc.Server, int]:
    """A started-ready (not started) server for ``servicer``; returns it and its port.

    ``max_workers`` bounds concurrent RPCs: sync pushes wait for their group,
    so it must exceed the number of workers (each holds one thread at most).
    With ``job_secrets`` every call must carry the job token (TLS when the
    secrets hold a certificate); without, the server is open (tests, benchmarks).

    Raises:
        RuntimeError: the port cannot be bound.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="ps-rpc"),
                         options=GRPC_OPTIONS, maximum_concurrent_rpcs=max_workers * 4,
                         interceptors=auth.server_interceptors(job_secrets))
    add_pserver(servicer, server)
    bound = auth.add_port(server, f"{host}:{port}", job_secrets)
    if bound == 0:
        raise RuntimeError(f"cannot bind the PS server to {host}:{port}")
    return server, bound


def start_server(servicer: PServicer, port: int = 0, host: str = "0.0.0.0",
                 max_workers: int = 64, job_secrets: Optional[auth.JobSecrets] = None
                 ) -> tuple[grpc.Server, int]:
    """Build and start the server; returns it and the bound port."""
    server, bound = build_server(servicer, port, host, max_workers, job_secrets)
    server.start()
    logger.info("PS %d gRPC server listening on %s:%d (%s)", servicer.shard.config.ps_id, host,
                bound, auth.describe(job_secrets))
    return server, bound
