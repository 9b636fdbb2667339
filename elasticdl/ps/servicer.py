"""The ``PServer`` gRPC service over a :class:`~elasticdl.ps.shard.PSShard`.

Every request is validated before it touches the shard: unknown names, wrong
shapes or dtypes, ids out of range or on another PS answer INVALID_ARGUMENT
with a message, a push before any model FAILED_PRECONDITION; the PS keeps
serving either way.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional, TypeVar

import grpc
import numpy as np
import torch

from elasticdl.checkpoint import paths as ckpt_paths
from elasticdl.checkpoint import ps_shards as ps_ckpt
from elasticdl.checkpoint import staging
from elasticdl.checkpoint.single import CheckpointError
from elasticdl.common import auth, chunk_wire, faults
from elasticdl.common import tensor_codec as codec
from elasticdl.common.intervals import IntervalSet
from elasticdl.common.rpc_service import Malformed, abort_unexpected, short
from elasticdl.data.api import DataError
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc
from elasticdl.ps import shard_checkpoint as shard_ckpt
from elasticdl.ps.model_push import ModelPushes
from elasticdl.ps.shard import (
    GradientPush,
    NotInitializedError,
    PSShard,
    PushResult,
    RollbackPendingError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _guard(method: Callable[..., T]) -> Callable[..., T]:
    """Map validation failures to gRPC status codes (the server keeps serving)."""

    @functools.wraps(method)
    def wrapper(self: PServicer, request: Any, context: grpc.ServicerContext) -> T:
        try:
            if isinstance(request, Malformed):
                raise ValueError(request.error)
            return method(self, request, context)
        except ValueError as e:
            logger.warning("%s: invalid request: %s", method.__name__, short(str(e), 300))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, short(str(e)))
        except NotInitializedError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, short(str(e)))
        except RollbackPendingError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, short(str(e)))
        except (CheckpointError, OSError) as e:
            logger.error("%s failed: %s", method.__name__, e)
            context.abort(grpc.StatusCode.INTERNAL, short(f"{type(e).__name__}: {e}"))
        except Exception as e:  # noqa: BLE001 - MemoryError or a bug: refused, clearly
            abort_unexpected(context, method.__name__, e, "PS")
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    return wrapper


MAX_ID = (1 << 31) - 1            # worker ids
MAX_VERSION = (1 << 53) - 1       # model versions
MAX_IDS_PER_PULL = 1 << 24        # embedding ids in one pull
MAX_PULL_BYTES = 1 << 30          # rows one pull may allocate
MAX_TABLE_DIM = 1 << 16
MAX_TENSORS = 100_000             # tensors / tables in one message


def check_range(what: str, value: float, low: float, high: float) -> None:
    """Raise ValueError unless ``low <= value <= high`` (NaN fails)."""
    if not low <= value <= high:
        raise ValueError(f"{what} must be in [{low}, {high}], got {value}")


def check_push_header(version: int, worker_id: int, learning_rate: float,
                      current: int) -> bool:
    """Validate a push's header: a sane worker id, a finite non-negative learning
    rate, a version >= 0. Returns False for a version this PS never made (a PS
    restored from an older checkpoint): the push is rejected like a stale one and
    the worker pulls again."""
    check_range("worker_id", worker_id, 0, MAX_ID)
    check_range("learning_rate", learning_rate, 0.0, 1e6)
    check_range("version", version, 0, MAX_VERSION)
    if version > current:
        logger.warning("rejected gradients of version %d from worker %d: this PS is at "
                       "version %d", version, worker_id, current)
        return False
    return True


def _push_response(result: PushResult) -> pb.PushGradientsResponse:
    return pb.PushGradientsResponse(accepted=result.accepted, version=result.version,
                                    duplicate=result.duplicate,
                                    learning_rate=result.learning_rate)


def _ids_of(ids: Any, id_tensor: pb.Tensor, has_tensor: bool, what: str) -> np.ndarray:
    if has_tensor:
        if len(ids):
            raise ValueError(f"{what}: give ids or id_tensor, not both")
        return codec.decode_ids(id_tensor, f"{what} ids")
    return np.array(ids, dtype=np.int64)


def decode_rows(rows: pb.EmbeddingRows, shard: PSShard) -> tuple[str, np.ndarray, torch.Tensor]:
    """``(table, ids, values)`` of an EmbeddingRows message, checked against the table."""
    table = shard.params.table(rows.table)
    what = f"gradient of table {rows.table!r}"
    ids = _ids_of(rows.ids, rows.id_tensor, rows.HasField("id_tensor"), what)
    values = codec.decode(rows.values, table.spec.dtype, [ids.shape[0], table.spec.dim])
    return rows.table, ids, values


MAX_INTERVALS = 1 << 22   # numbers in one closed-set message


def parse_intervals(flat: Any, what: str) -> IntervalSet:
    """A flat ``[lo, hi, ...]`` list of sorted, disjoint, non-empty intervals.

    Raises:
        ValueError: odd length, an empty or reversed interval, or not sorted.
    """
    check_range(f"{what}: length", len(flat), 0, MAX_INTERVALS)
    if len(flat) % 2:
        raise ValueError(f"{what}: flat intervals need an even length, got {len(flat)}")
    prev = None
    for i in range(0, len(flat), 2):
        lo, hi = flat[i], flat[i + 1]
        if lo >= hi or (prev is not None and lo < prev):
            raise ValueError(f"{what}: intervals must be non-empty, sorted and disjoint; "
                             f"[{lo}, {hi}) at position {i // 2} (previous end {prev})")
        prev = hi
    return IntervalSet.from_flat(list(flat))


def _applied_response(version: int, entries: list[tuple[int, int, int, int]],
                      closed: IntervalSet, generation: int) -> pb.AppliedResponse:
    return pb.AppliedResponse(version=version, closed=closed.to_flat(), generation=generation,
                              pushes=[pb.AppliedPush(task_id=t, minibatch=mb, num_records=n,
                                                     version=v) for t, mb, n, v in entries])


class PServicer(pb_grpc.PServerServicer):
    """gRPC handlers of one PS."""

    def __init__(self, shard: PSShard, chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES):
        self.shard = shard
        self.chunk_bytes = chunk_bytes
        self._cache_lock = threading.Lock()
        self._chunk_cache: tuple[int, int, list[bytes]] = (-1, 0, [])
        # the dense parameters of one version, encoded (pull_dense and the pushes that
        # want them answer every worker from it; buffers change between versions: not kept)
        self._dense_cache: tuple[int, list[pb.Tensor]] = (-1, [])
        self._model_pushes = ModelPushes(shard)

    # ------------------------------------------------------------ model
    @_guard
    def push_model(self, request: pb.Model, context: grpc.ServicerContext) -> pb.PushModelResponse:
        """One message of a model push (see :mod:`elasticdl.ps.model_push`)."""
        accepted = self._model_pushes.push(request)
        return pb.PushModelResponse(accepted=accepted, version=self.shard.version)

    # ------------------------------------------------------------ pulls
    @_guard
    def pull_dense(self, request: pb.PullDenseRequest,
                   context: grpc.ServicerContext) -> pb.PullDenseResponse:
        check_range("version", request.version, -1, MAX_VERSION)
        with self.shard.lock:
            initialized, version, dense, buffers = self._dense_messages(request.version)
        return pb.PullDenseResponse(initialized=initialized, version=version, dense=dense,
                                    buffers=buffers)

    def _dense_messages(self, worker_version: int
                        ) -> tuple[bool, int, list[pb.Tensor], list[pb.Tensor]]:
        """``(initialized, version, dense, buffers)`` as ``pull_dense`` answers them (empty
        lists: the worker is current); the dense ones encoded once per version (versions
        never repeat on a PS: a rollback continues above). Caller holds the shard lock."""
        shard = self.shard
        initialized, version, tensors = shard.snapshot_dense(worker_version)
        if tensors is None:
            return initialized, version, [], []
        buffers = [codec.encode(t, n) for n, t in shard.params.buffers.items()]
        with self._cache_lock:
            cached_version, dense = self._dense_cache
        if cached_version != version:
            dense = [codec.encode(t, n) for n, t in shard.params.dense.items()]
            with self._cache_lock:
                self._dense_cache = (version, dense)
        return initialized, version, dense, buffers

    def _answer(self, result: PushResult, want_dense: bool) -> pb.PushGradientsResponse:
        """A push's reply; with ``want_dense`` (and accepted) the dense parameters and
        buffers as they are now (the worker's next pull, saved)."""
        resp = _push_response(result)
        if want_dense and result.accepted:
            with self.shard.lock:
                _, version, dense, buffers = self._dense_messages(-1)
            resp.has_dense, resp.dense_version = True, version
            resp.dense.extend(dense)
            resp.buffers.extend(buffers)
        return resp

    @_guard
    def pull_dense_chunks(self, request: pb.PullDenseRequest,
                          context: grpc.ServicerContext) -> Iterator[bytes]:
        """Serialised ``DenseChunk`` messages (encoded once per version and chunk size)."""
        check_range("version", request.version, -1, MAX_VERSION)
        chunk_bytes = self.chunk_bytes
        if request.chunk_bytes:
            chunk_bytes = chunk_wire.check_chunk_bytes(request.chunk_bytes)
        return iter(self._chunks(request.version, chunk_bytes))

    def _chunks(self, worker_version: int, chunk_bytes: int) -> list[bytes]:
        shard = self.shard
        with shard.lock:
            initialized, version, tensors = shard.snapshot_dense(worker_version)
            if tensors is None:
                return [chunk_wire.dense_chunk_bytes(initialized, version, False, None)]
            def encode(items: Any, is_buffer: bool) -> list[bytes]:
                out = []
                for name, t in items:
                    view = codec.byte_view(t.detach())
                    for _, parts in chunk_wire.tensor_chunks_wire(
                            name, view, codec.dtype_name(t.dtype), tuple(t.shape), chunk_bytes):
                        out.append(chunk_wire.dense_chunk_bytes(True, version, is_buffer, parts))
                return out

            # the dense chunks once per version; buffers (a sync push's statistics are
            # copied as it arrives, before the version moves) every time
            with self._cache_lock:
                cached_version, cached_size, chunks = self._chunk_cache
            if cached_version != version or cached_size != chunk_bytes:
                chunks = encode(shard.params.dense.items(), False)
                with self._cache_lock:
                    self._chunk_cache = (version, chunk_bytes, chunks)
            chunks = chunks + encode(shard.params.buffers.items(), True)
            return chunks or [chunk_wire.dense_chunk_bytes(True, version, False, None)]

    @_guard
    def pull_embedding(self, request: pb.PullEmbeddingRequest,
                       context: grpc.ServicerContext) -> pb.Tensor:
        return self._pull(request, 0)

    @_guard
    def pull_embeddings(self, request: pb.PullEmbeddingsRequest,
                        context: grpc.ServicerContext) -> pb.PullEmbeddingsResponse:
        """Several tables' rows in one call, each as :meth:`pull_embedding`; the limits
        are on the whole call."""
        total = 0
        rows = []
        for part in request.tables:
            rows.append(self._pull(part, total))
            total += 2 * len(rows[-1].content)   # (as _pull counts: 8 bytes a value)
        return pb.PullEmbeddingsResponse(rows=rows)

    def _pull(self, request: pb.PullEmbeddingRequest, bytes_before: int) -> pb.Tensor:
        what = f"pull of table {request.table!r}"
        if not self.shard.initialized:   # (a restarted PS: not "unknown table")
            raise NotInitializedError(f"PS {self.shard.config.ps_id} has no model yet "
                                      "(push_model)")
        spec = self.shard.params.table(request.table).spec
        count = len(request.ids) or (request.id_tensor.shape[0]
                                     if len(request.id_tensor.shape) == 1 else 0)
        check_range(f"{what}: number of ids", count, 0, MAX_IDS_PER_PULL)
        check_range(f"{what}: bytes of rows", bytes_before + count * spec.dim * 8, 0,
                    MAX_PULL_BYTES)
        ids = _ids_of(request.ids, request.id_tensor, request.HasField("id_tensor"), what)
        rows = self.shard.pull_embedding(request.table, ids, create=not request.no_create)
        return codec.encode(rows, request.table)

    @_guard
    def export_rows(self, request: pb.ExportRowsRequest,
                    context: grpc.ServicerContext) -> Iterator[pb.EmbeddingRows]:
        """The rows of a table this PS holds, ids ascending, in pages (sparse export)."""
        spec = self.shard.params.table(request.table).spec   # ValueError: unknown table
        check_range("max_rows", request.max_rows, 0, MAX_IDS_PER_PULL)
        max_rows = request.max_rows or max(1, (4 << 20) // (spec.dim * 4))
        pages = self.shard.export_rows(request.table, max_rows)
        return (pb.EmbeddingRows(table=request.table, id_tensor=codec.encode_ids(ids),
                                 values=codec.encode(rows)) for ids, rows in pages)

    # ------------------------------------------------------------ pushes
    def _dense_grad(self, msg: pb.Tensor) -> torch.Tensor:
        param = self.shard.params.dense.get(msg.name)
        if param is None:
            raise ValueError(f"gradient for unknown parameter {msg.name!r} on PS "
                             f"{self.shard.config.ps_id}")
        return codec.decode(msg, param.dtype, list(param.shape))

    def _buffer(self, msg: pb.Tensor) -> torch.Tensor:
        buf = self.shard.params.buffers.get(msg.name)
        if buf is None:
            raise ValueError(f"unknown buffer {msg.name!r} on PS {self.shard.config.ps_id}")
        return codec.decode(msg, buf.dtype, list(buf.shape))

    @_guard
    def push_gradients(self, request: pb.PushGradientsRequest,
                       context: grpc.ServicerContext) -> pb.PushGradientsResponse:
        self._require_init()
        if not check_push_header(request.version, request.worker_id, request.learning_rate,
                                 self.shard.version):
            return pb.PushGradientsResponse(accepted=False, version=self.shard.version)
        push = GradientPush(version=request.version, worker_id=request.worker_id,
                            learning_rate=request.learning_rate, task_id=request.task_id,
                            minibatch=request.minibatch, num_records=request.num_records,
                            epoch=request.epoch, grad_scale=request.grad_scale or 1.0,
                            discard=request.discard, lr_reductions=request.lr_reductions,
                            lr_scale=request.lr_scale or 1.0, sync_group=request.sync_group)
        for msg in request.dense:
            if msg.name in push.dense:
                raise ValueError(f"gradient of {msg.name!r} given twice")
            push.dense[msg.name] = self._dense_grad(msg)
        push.buffers = {b.name: self._buffer(b) for b in request.buffers}
        push.sparse = [decode_rows(rows, self.shard) for rows in request.sparse]
        return self._answer(self.shard.push_gradients(push), request.want_dense)

    @_guard
    def push_gradient_chunks(self, request_iterator: Iterator[chunk_wire.GradientChunkView],
                             context: grpc.ServicerContext) -> pb.PushGradientsResponse:
        self._require_init()
        shard = self.shard
        expected = {n: (p.dtype, list(p.shape)) for n, p in shard.params.dense.items()}
        assembler = codec.ChunkAssembler(expected=expected)
        push: Optional[GradientPush] = None
        for msg in request_iterator:
            if msg.error:
                raise ValueError(f"push_gradient_chunks: {msg.error}")
            if push is None:
                if not check_push_header(msg.version, msg.worker_id, msg.learning_rate,
                                         shard.version):
                    return pb.PushGradientsResponse(accepted=False, version=shard.version)
                push = GradientPush(version=msg.version, worker_id=msg.worker_id,
                                    learning_rate=msg.learning_rate, task_id=msg.task_id,
                                    minibatch=msg.minibatch, num_records=msg.num_records,
                                    epoch=msg.epoch, lr_reductions=msg.lr_reductions,
                                    lr_scale=msg.lr_scale or 1.0,
                                    sync_group=msg.sync_group)
            if msg.grad_scale:  # the worker knows it once backward is done: any message
                push.grad_scale = msg.grad_scale
            push.discard = push.discard or msg.discard
            if msg.dense is not None:
                whole = codec.whole_chunk_view(msg.dense, expected)  # no copy
                done = msg.dense.name if whole is not None else assembler.add(msg.dense)
                if done is not None:
                    if done in push.dense:
                        raise ValueError(f"gradient of {done!r} given twice")
                    push.dense[done] = whole if whole is not None else assembler.pop(done)
            if msg.sparse is not None:
                push.sparse.append(decode_rows(msg.sparse, shard))
            if msg.buffer is not None:
                push.buffers[msg.buffer.name] = self._buffer(msg.buffer)
        if push is None:
            raise ValueError("push_gradient_chunks: empty stream")
        missing = assembler.incomplete()
        if missing:
            raise ValueError(f"gradients incomplete at end of stream: {', '.join(missing)}")
        return _push_response(shard.push_gradients(push))

    def _require_init(self) -> None:
        if not self.shard.initialized:
            raise NotInitializedError(f"PS {self.shard.config.ps_id} has no model yet "
                                      "(push_model)")

    # ------------------------------------------------------------ other
    @_guard
    def save_checkpoint(self, request: pb.SaveCheckpointRequest,
                        context: grpc.ServicerContext) -> pb.SaveCheckpointResponse:
        """Write this shard's current state into the job's checkpoint directory with
        the job's retention, as its current version or ``version_at_least`` when that
        is higher (the directory only: see :func:`shard_ckpt.save_shard`)."""
        cfg = self.shard.config
        if not cfg.checkpoint_dir:
            raise NotInitializedError("save_checkpoint: the job has no --checkpoint_dir")
        self._require_init()
        check_range("version_at_least", request.version_at_least, 0, 2**62)
        at = max(self.shard.version, request.version_at_least) \
            if request.version_at_least else None
        path = shard_ckpt.save_shard(self.shard, cfg.checkpoint_dir, at, cfg.keep_checkpoint_max)
        staging.flush(cfg.checkpoint_dir)   # staged: the shard up (and DONE if it is last)
        version = ckpt_paths.version_of(os.path.dirname(path))  # the version it wrote
        return pb.SaveCheckpointResponse(path=path, version=version)

    def status(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.PSStatus:
        cfg = self.shard.config
        shard = self.shard
        with shard.lock:
            led = shard.ledger
            return pb.PSStatus(ps_id=cfg.ps_id, num_ps=cfg.num_ps,
                               initialized=shard.initialized, version=shard.version,
                               applied_pushes=led.applied_total,
                               duplicates_ignored=shard.duplicates_ignored,
                               live_pushes=len(led), closed_intervals=led.closed.num_intervals,
                               generation=led.generation)

    @_guard
    def applied(self, request: pb.AppliedRequest,
                context: grpc.ServicerContext) -> pb.AppliedResponse:
        check_range("number of task ids", len(request.task_ids), 0, MAX_TENSORS)
        version, entries, closed = self.shard.applied_and_closed(
            list(request.task_ids) or None)
        return _applied_response(version, entries, closed, self.shard.ledger.generation)

    @_guard
    def settle(self, request: pb.SettleRequest,
               context: grpc.ServicerContext) -> pb.SettleResponse:
        """The master's closed tasks (module :mod:`elasticdl.common.ledger`)."""
        caller = auth.caller_replica(context)
        if caller not in (None, "master"):
            raise ValueError(f"settle: only the master settles tasks, not {caller}")
        closed = parse_intervals(request.closed, "settle: closed")
        folded = self.shard.settle(request.generation, closed)
        led = self.shard.ledger
        return pb.SettleResponse(accepted=folded is not None, folded=folded or 0,
                                 generation=led.generation, live_pushes=len(led))

    @_guard
    def rollback(self, request: pb.RollbackRequest,
                 context: grpc.ServicerContext) -> pb.AppliedResponse:
        """Restore checkpoint version ``checkpoint_version`` of this job's checkpoint
        directory (never a path from the request) and continue at ``new_version``;
        answers the restored ledger."""
        caller = auth.caller_replica(context)
        if caller not in (None, "master"):
            raise ValueError(f"rollback: only the master rolls a PS back, not {caller}")
        check_range("checkpoint_version", request.checkpoint_version, 0, MAX_VERSION)
        check_range("new_version", request.new_version, 0, MAX_VERSION)
        key = (request.protocol_id, request.incarnation, request.new_version)
        repeat = self.shard.rollback_answer(key) if request.protocol_id else None
        if repeat is not None:  # the same request again (a lost reply): the same answer
            with self.shard.lock:   # (closed since: held whole, still true)
                closed = self.shard.ledger.closed.copy()
            return _applied_response(request.new_version, list(repeat), closed,
                                     request.new_version)
        vdir = self._rollback_dir(request)
        entries = self.shard.rollback(lambda shard: shard_ckpt.restore_shard(shard, vdir),
                                      request.new_version, key=key)
        faults.point("after_restore")
        with self.shard.lock:
            closed = self.shard.ledger.closed.copy()
        return _applied_response(request.new_version, entries, closed, request.new_version)

    def _rollback_dir(self, request: pb.RollbackRequest) -> str:
        """The version directory a rollback restores: the one the master names (its
        restore rule; only this job's checkpoints or its init checkpoint), else
        ``checkpoint_version`` of the job's checkpoint directory."""
        from elasticdl.checkpoint import restore  # no torch there

        if request.version_dir:
            spec = self.shard.job_spec
            try:   # the master names a staged checkpoint by its URL
                vdir = staging.to_local(request.version_dir)
                staging.ensure(vdir, self._own_shard())
            except (CheckpointError, DataError) as e:
                raise ValueError(f"rollback: {e}") from e
            if spec is None or not restore.allowed(spec, vdir):
                raise ValueError(f"rollback: {request.version_dir} is neither a complete "
                                 "version of this job's checkpoint directory nor its init "
                                 "checkpoint")
            return vdir
        ckpt_dir = self.shard.config.checkpoint_dir
        if not ckpt_dir:
            raise ValueError("rollback: this PS has no checkpoint directory")
        try:
            staging.ensure(ckpt_paths.version_dir(ckpt_dir, request.checkpoint_version),
                           self._own_shard())
            return ps_ckpt.version_dir_of(ckpt_dir, request.checkpoint_version)
        except (CheckpointError, DataError) as e:  # the caller named a version that is not there
            raise ValueError(f"rollback: {e}") from e

    def _own_shard(self) -> str:
        return f"ps-{self.shard.config.ps_id}-of-{self.shard.config.num_ps}.pt"

    def echo(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.Empty:
        return pb.Empty()
