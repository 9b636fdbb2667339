"""Registering a gRPC service from its descriptor, with lenient request parsing.

gRPC answers a request that fails to parse with INTERNAL ("Exception
deserializing request!"), which reads like a server bug. Here each request
parser returns a :class:`Malformed` instead of raising, and the servicers'
guards answer it with INVALID_ARGUMENT naming the problem.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Optional

import grpc
from google.protobuf.message import DecodeError

from elasticdl.proto import elasticdl_pb2 as pb

logger = logging.getLogger(__name__)

_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass(frozen=True)
class Malformed:
    """A request that did not parse; ``error`` says why."""

    error: str


def lenient(parse: Callable[[bytes], Any], what: str) -> Callable[[bytes], Any]:
    def parse_or_malformed(data: bytes) -> Any:
        try:
            return parse(data)
        except (DecodeError, ValueError, RecursionError) as e:
            return Malformed(f"malformed {what}: {e}")
    return parse_or_malformed


def add_service(servicer: Any, server: grpc.Server, service: str,
                parsers: Optional[Mapping[str, Callable[[bytes], Any]]] = None,
                serializer: Optional[Callable[[Any], bytes]] = None) -> None:
    """Register every method of ``service`` (from the generated descriptor) on
    ``server``; ``parsers`` replace the generated request parsing per method."""
    desc = pb.DESCRIPTOR.services_by_name[service]
    handlers = {}
    for method in desc.methods:
        request_cls = getattr(pb, method.input_type.name)
        parse = (parsers or {}).get(method.name) or lenient(request_cls.FromString,
                                                            method.input_type.name)
        factory = _FACTORIES[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name), request_deserializer=parse,
            response_serializer=serializer or (lambda m: m.SerializeToString()))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(desc.full_name,
                                                                          handlers),))


def short(text: str, limit: int = 2000) -> str:
    """An error message fit for gRPC status details (a caller-supplied 70 KB name
    echoed back would exceed the client's metadata limit)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def abort_unexpected(context: grpc.ServicerContext, method: str, error: Exception,
                     server: str) -> NoReturn:
    """Answer an error no guard expected: RESOURCE_EXHAUSTED for MemoryError,
    INTERNAL (a bug must not look like a bad request) for anything else. The
    request is refused; the server keeps serving."""
    if isinstance(error, MemoryError):
        logger.error("%s: out of memory; request refused, %s keeps serving", method, server)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"{method}: the {server} ran out of memory serving this request")
    logger.error("%s: internal error", method, exc_info=error)
    context.abort(grpc.StatusCode.INTERNAL,
                  short(f"{method}: internal error {type(error).__name__}: {error}"))
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover
