"""One streamed gradient push to one parameter server, and the stub it uses.

:class:`PushStream` is a ``push_gradient_chunks`` call fed while backward still
runs (autograd hooks queue tensors; the gRPC request iterator encodes and sends
them); :class:`PSStub` is the generated stub with the two bulk streams
(de)serialised by :mod:`~elasticdl.common.chunk_wire`. :class:`PSClient`
(:mod:`elasticdl.worker.ps_client`) opens the streams and retries them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Optional, Protocol, Union

import grpc
import numpy as np
import torch

from elasticdl.common import chunk_wire
from elasticdl.common import tensor_codec as codec
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc

Ready = Optional[Callable[[], None]]
Identity = tuple[int, int, int]  # task id, minibatch (1-based; 0: none), records


class PushReply(tuple):
    """A PS's answer to a push: ``(accepted, version)``, ``learning_rate`` (the first
    param group's lr the push's group was applied with) and ``dense_version``: the
    version of the dense parameters the answer brought (-1: none)."""

    learning_rate: float
    dense_version: int

    def __new__(cls, accepted: bool, version: int, learning_rate: float = 0.0,
                dense_version: int = -1) -> PushReply:
        out = super().__new__(cls, (accepted, version))
        out.learning_rate = learning_rate
        out.dense_version = dense_version
        return out

    @classmethod
    def of(cls, resp: pb.PushGradientsResponse) -> PushReply:
        return cls(resp.accepted, resp.version, resp.learning_rate,
                   resp.dense_version if resp.has_dense else -1)


class PSStub(pb_grpc.PServerStub):
    """The generated stub, with the two bulk streams (de)serialised by
    :mod:`~elasticdl.common.chunk_wire` (same wire format, fewer copies)."""

    def __init__(self, channel: grpc.Channel):
        super().__init__(channel)
        self.push_gradient_chunks = channel.stream_unary(
            "/elasticdl.PServer/push_gradient_chunks", request_serializer=chunk_wire.serialize,
            response_deserializer=pb.PushGradientsResponse.FromString)
        self.pull_dense_chunks = channel.unary_stream(
            "/elasticdl.PServer/pull_dense_chunks",
            request_serializer=pb.PullDenseRequest.SerializeToString,
            response_deserializer=chunk_wire.parse_dense_chunk)


class StreamClient(Protocol):
    """What a :class:`PushStream` uses of its client
    (:class:`~elasticdl.worker.ps_client.PSClient`)."""

    rpc_timeout_s: float
    chunk_bytes: int

    def submit(self, ps: int, fn: Callable[[PSStub], Any], what: str) -> Future: ...


class PushStream:
    """A ``push_gradient_chunks`` call fed while backward still runs.

    ``put_*`` may be called from autograd hooks: they only queue the tensor
    (with an optional ``ready`` callable, e.g. a CUDA event's synchronize);
    the gRPC request iterator encodes and sends it. :meth:`finish` closes the
    stream (with the push's ``grad_scale``/``discard`` in its last message) and
    returns a :class:`PushReply`.
    """

    def __init__(self, client: StreamClient, ps: int, version: int, worker_id: int,
                 identity: Identity = (0, 0, 0), epoch: int = 0, lr_reductions: int = 0,
                 lr_scale: float = 1.0, sync_group: int = 0):
        self._client = client
        self.ps = ps
        task_id, minibatch, num_records = identity
        self._header = {"version": version, "worker_id": worker_id, "task_id": task_id,
                        "minibatch": minibatch, "num_records": num_records, "epoch": epoch,
                        "lr_reductions": lr_reductions, "lr_scale": lr_scale,
                        "sync_group": sync_group}
        self._items: list[tuple[str, str, Any, Ready]] = []
        self._closed = False
        self._aborted = False
        self._cond = threading.Condition()
        self._future = client.submit(ps, self._call, "push_gradient_chunks")

    def put_dense(self, name: str, grad: torch.Tensor, ready: Ready = None) -> None:
        self._put(("dense", name, grad, ready))

    def put_sparse(self, table: str, ids: np.ndarray, grad: torch.Tensor,
                   ready: Ready = None) -> None:
        self._put(("sparse", table, (ids, grad), ready))

    def put_buffer(self, name: str, value: torch.Tensor) -> None:
        self._put(("buffer", name, value, None))

    def _put(self, item: tuple[str, str, Any, Ready]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("push stream already finished")
            self._items.append(item)
            self._cond.notify()

    def finish(self, grad_scale: float = 1.0, discard: bool = False) -> PushReply:
        self.close(grad_scale, discard)
        return self._future.result()

    def close(self, grad_scale: float = 1.0, discard: bool = False) -> None:
        """End the stream: the PS applies what it received, times ``grad_scale``
        (nothing when ``discard``)."""
        with self._cond:
            if not self._closed and (grad_scale != 1.0 or discard):
                self._items.append(("commit", "", (grad_scale, discard), None))
            self._closed = True
            self._cond.notify()

    def abort(self) -> None:
        """Cancel the push: the PS discards what it received."""
        with self._cond:
            self._aborted = self._closed = True
            self._cond.notify()

    def _call(self, stub: PSStub) -> PushReply:
        resp = stub.push_gradient_chunks(self._requests(), timeout=self._client.rpc_timeout_s)
        return PushReply.of(resp)

    def _requests(self) -> Iterator[Union[bytes, pb.GradientChunk]]:
        """Replays every queued item (so a retry after a reconnect resends all)."""
        header: Optional[dict[str, Any]] = dict(self._header)
        i = 0
        deadline = time.monotonic() + self._client.rpc_timeout_s
        while True:
            with self._cond:
                while i >= len(self._items) and not self._closed:
                    if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                        raise TimeoutError("push stream: no gradient queued in time")
                if self._aborted:
                    raise RuntimeError("push aborted by the worker")
                if i >= len(self._items):
                    break
                kind, name, value, ready = self._items[i]
            i += 1
            if ready is not None:
                ready()
            for msg in self._encode(kind, name, value, header):
                header = None
                yield msg
        if header is not None:  # nothing at all for this PS: the push still counts
            yield pb.GradientChunk(**header)

    def _encode(self, kind: str, name: str, value: Any,
                header: Optional[dict[str, Any]]) -> Iterator[Union[bytes, pb.GradientChunk]]:
        """Messages of one item; ``header`` goes into the first (the stream's first)."""
        if kind == "dense":
            t = value.detach().contiguous()
            for _, parts in chunk_wire.tensor_chunks_wire(
                    name, codec.byte_view(t), codec.dtype_name(t.dtype), tuple(t.shape),
                    self._client.chunk_bytes):
                yield chunk_wire.gradient_chunk_bytes(parts, **(header or {}))
                header = None
            return
        if kind == "sparse":
            ids, grad = value
            msg = pb.GradientChunk(sparse=pb.EmbeddingRows(
                table=name, id_tensor=codec.encode_ids(ids), values=codec.encode(grad)))
        elif kind == "commit":
            grad_scale, discard = value
            msg = pb.GradientChunk(grad_scale=grad_scale, discard=discard)
        else:
            msg = pb.GradientChunk(buffer=codec.encode(value, name))
        if header:
            msg.MergeFrom(pb.GradientChunk(**header))
        yield msg
