"""A worker's client of the parameter servers.

Placement: dense parameter ``name`` lives on PS
``crc32(name) % num_ps``; row ``id`` of every table on PS ``id % num_ps``.
Requests to different PS run concurrently on a thread pool. Every call has a
deadline; a PS that is unreachable (restarting: a relaunched PS may come back
on the same address) is polled until it serves again, for at most
``reconnect_timeout_s``, and the call is then retried, else
``ConnectionError`` is raised.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, TypeVar

import grpc
import numpy as np
import torch

from elasticdl.common import auth, chunk_wire
from elasticdl.common import tensor_codec as codec
from elasticdl.common.intervals import IntervalSet
from elasticdl.common.tables import TableSpec, dense_owner
from elasticdl.common.wire import GRPC_OPTIONS
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.worker.ps_stream import Identity, PSStub, PushReply, PushStream

__all__ = ["Identity", "PSClient", "PSError", "PSNotInitializedError", "PSStub", "PushStream"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
ROLLBACK_PENDING = "waiting for the master's rollback"  # in a PS's UNAVAILABLE details


def _decode_dense(ps: int, resp: Any, dest: Mapping[str, torch.Tensor]) -> None:
    """A ``PullDenseResponse``'s (or a push reply's) tensors into ``dest`` by name."""
    for msg in list(resp.dense) + list(resp.buffers):
        if msg.name not in dest:
            raise ValueError(f"PS {ps} sent unknown tensor {msg.name!r}")
        codec.decode_into(msg, dest[msg.name])


def _place(out: torch.Tensor, positions: np.ndarray, rows: torch.Tensor) -> None:
    """A PS's ``rows`` into their ``positions`` of a pull's output (all of it: a copy)."""
    if positions.shape[0] == out.shape[0]:
        out.copy_(rows)
    else:
        out.index_copy_(0, torch.from_numpy(positions), rows)


class PSError(RuntimeError):
    """A PS call failed for a reason retrying cannot fix."""


class PSVersionsDifferError(PSError):
    """The PS saved a checkpoint at different versions: no one version names it."""


class PSNotInitializedError(PSError):
    """The PS has no model (it restarted without a checkpoint): push_model again."""

    def __init__(self, ps: int, message: str):
        super().__init__(message)
        self.ps = ps


POLICY_FIELDS = ("admit_after", "ttl_versions", "max_rows", "ttl_seconds")
"""A table's admission and eviction settings (TableSpec and EmbeddingTableInfo alike)."""


def table_info(spec: TableSpec) -> pb.EmbeddingTableInfo:
    info = pb.EmbeddingTableInfo(name=spec.name, dim=spec.dim, initializer=spec.initializer,
                                 dtype=codec.dtype_name(spec.dtype),
                                 num_embeddings=spec.num_embeddings, seed=spec.seed,
                                 padding_idx=spec.padding_idx, rows_pushed=spec.explicit)
    for name in POLICY_FIELDS:   # set only when the layer does
        value = getattr(spec, name)
        if value is not None:
            setattr(info, name, value)
    return info


class PSClient:
    """Talks to ``addrs`` (``host:port`` of PS 0..n-1)."""

    def __init__(self, addrs: Sequence[str], rpc_timeout_s: float = 120.0,
                 reconnect_timeout_s: float = 120.0,
                 chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES):
        if not addrs:
            raise ValueError("PSClient needs at least one PS address")
        self.addrs = list(addrs)
        self.rpc_timeout_s = rpc_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.chunk_bytes = chunk_bytes
        self._locks = [threading.Lock() for _ in self.addrs]
        self._generation = [0] * len(self.addrs)
        self._channels = [self._channel(a) for a in self.addrs]
        self._stubs = [PSStub(c) for c in self._channels]
        self._pool = ThreadPoolExecutor(max_workers=max(4, 3 * len(self.addrs)),
                                        thread_name_prefix="ps-client")

    @staticmethod
    def _channel(addr: str) -> grpc.Channel:
        return auth.client_channel(addr, GRPC_OPTIONS)

    @property
    def num_ps(self) -> int:
        return len(self.addrs)

    # ------------------------------------------------------- placement
    def dense_owner(self, name: str) -> int:
        return dense_owner(name, self.num_ps)

    def partition(self, named: Mapping[str, T]) -> list[dict[str, T]]:
        """Split a name -> value mapping by owning PS."""
        parts: list[dict[str, T]] = [{} for _ in self.addrs]
        for name, value in named.items():
            parts[self.dense_owner(name)][name] = value
        return parts

    def partition_ids(self, ids: np.ndarray) -> list[np.ndarray]:
        """Positions into ``ids`` owned by each PS."""
        if self.num_ps == 1:
            return [np.arange(ids.shape[0])]
        owner = ids % self.num_ps
        return [np.nonzero(owner == i)[0] for i in range(self.num_ps)]

    # ------------------------------------------------------- calls
    def call(self, ps: int, fn: Callable[[PSStub], T], what: str) -> T:
        """``fn(stub)`` with error mapping; waits out a PS restart, then retries."""
        deadline: Optional[float] = None
        while True:
            generation = self._generation[ps]
            try:
                return fn(self._stubs[ps])
            except ValueError:   # "Channel closed": see _reconnected_meanwhile
                if self._reconnected_meanwhile(ps, generation):
                    continue
                raise
            except grpc.RpcError as e:
                code = e.code()  # type: ignore[attr-defined]
                details = e.details()  # type: ignore[attr-defined]
                if code == grpc.StatusCode.CANCELLED and \
                        self._reconnected_meanwhile(ps, generation):
                    continue
                where = f"PS {ps} ({self.addrs[ps]})"
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ValueError(f"{where} rejected {what}: {details}") from None
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    raise PSNotInitializedError(ps, f"{where}: {details}") from None
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise TimeoutError(f"{what} on {where} timed out") from None
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise PSError(f"{what} on {where} failed: {code.name}: {details}") from None
                if deadline is None:
                    logger.warning("%s unavailable during %s (%s); waiting up to %.0f s for "
                                   "it to serve again", where, what, details,
                                   self.reconnect_timeout_s)
                    deadline = time.monotonic() + self.reconnect_timeout_s
                if ROLLBACK_PENDING in (details or ""):
                    # the PS serves but waits for the master's rollback: no reconnect
                    if time.monotonic() > deadline:
                        raise ConnectionError(f"{where} still waiting for its rollback after "
                                              f"{self.reconnect_timeout_s:.0f} s") from None
                    time.sleep(0.2)
                    continue
                self._reconnect(ps, generation, deadline)

    def _reconnected_meanwhile(self, ps: int, generation: int) -> bool:
        """Whether a concurrent call to the same PS (a step's table pull beside its dense
        pull) reconnected since ``generation``, closing the channel this call used: waits
        for a reconnect under way (it holds the PS's lock, bounded by its deadline)."""
        with self._locks[ps]:
            pass
        return self._generation[ps] != generation

    def _reconnect(self, ps: int, generation: int, deadline: float) -> None:
        with self._locks[ps]:
            if self._generation[ps] != generation:
                return  # another thread already reconnected
            self._channels[ps].close()
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConnectionError(f"PS {ps} at {self.addrs[ps]} did not come back "
                                          f"within {self.reconnect_timeout_s:.0f} s")
                channel = self._channel(self.addrs[ps])
                try:
                    grpc.channel_ready_future(channel).result(timeout=min(1.0, left))
                except grpc.FutureTimeoutError:
                    channel.close()
                    continue
                self._channels[ps] = channel
                self._stubs[ps] = PSStub(channel)
                self._generation[ps] += 1
                logger.info("reconnected to PS %d at %s", ps, self.addrs[ps])
                return

    def submit(self, ps: int, fn: Callable[[PSStub], T], what: str) -> Future:
        return self._pool.submit(self.call, ps, fn, what)

    def _all(self, fn: Callable[[int, PSStub], T], what: str,
             ps_list: Optional[Sequence[int]] = None) -> list[T]:
        """Run ``fn`` on each PS concurrently; re-raises the first failure."""
        targets = range(self.num_ps) if ps_list is None else ps_list
        futures = [self.submit(i, functools.partial(fn, i), what) for i in targets]
        return [f.result() for f in futures]

    # ------------------------------------------------------- operations
    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until every PS answers; ConnectionError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for i, channel in enumerate(self._channels):
            try:
                grpc.channel_ready_future(channel).result(
                    timeout=max(0.01, deadline - time.monotonic()))
            except grpc.FutureTimeoutError:
                raise ConnectionError(f"PS {i} at {self.addrs[i]} not reachable within "
                                      f"{timeout_s:.0f} s") from None

    def status(self) -> list[pb.PSStatus]:
        return self._all(lambda i, s: s.status(pb.Empty(), timeout=self.rpc_timeout_s),
                         "status")

    def push_model(self, version: int, dense: Mapping[str, torch.Tensor],
                   buffers: Mapping[str, torch.Tensor], tables: Sequence[TableSpec],
                   ps_list: Optional[Sequence[int]] = None) -> list[bool]:
        """Initialise PS (each gets its part); returns per PS whether it took it."""
        dparts, bparts = self.partition(dense), self.partition(buffers)
        infos = [table_info(t) for t in tables]

        def push(i: int, stub: PSStub) -> bool:
            model = pb.Model(version=version, embedding_tables=infos,
                             dense=[codec.encode(t, n) for n, t in dparts[i].items()],
                             buffers=[codec.encode(t, n) for n, t in bparts[i].items()])
            return stub.push_model(model, timeout=self.rpc_timeout_s).accepted

        return self._all(push, "push_model", ps_list)

    def pull_dense(self, versions: Sequence[int], dest: Mapping[str, torch.Tensor],
                   streaming: Sequence[bool], ps_list: Optional[Sequence[int]] = None
                   ) -> dict[int, tuple[bool, int, bool]]:
        """Pull each PS's tensors newer than ``versions[i]`` into ``dest`` (contiguous
        CPU tensors by name). Returns per PS ``(initialized, version, updated)``."""
        parts = self.partition(dest)

        def pull(i: int, stub: PSStub) -> tuple[bool, int, bool]:
            req = pb.PullDenseRequest(version=versions[i],
                                      chunk_bytes=chunk_wire.clamp_chunk_bytes(self.chunk_bytes))
            if not streaming[i]:
                resp = stub.pull_dense(req, timeout=self.rpc_timeout_s)
                _decode_dense(i, resp, parts[i])
                return resp.initialized, resp.version, bool(len(resp.dense) + len(resp.buffers))
            assembler = codec.ChunkAssembler(destinations=parts[i])
            initialized, version, updated = False, -1, False
            for msg in stub.pull_dense_chunks(req, timeout=self.rpc_timeout_s):
                initialized, version = msg.initialized, msg.version
                if msg.chunk is not None:
                    assembler.add(msg.chunk)
                    updated = True
            assembler.result()
            return initialized, version, updated

        targets = list(range(self.num_ps)) if ps_list is None else list(ps_list)
        return dict(zip(targets, self._all(pull, "pull_dense", targets)))

    def pull_embedding_unique(self, table: str, ids: np.ndarray, dim: int,
                              dtype: torch.dtype = torch.float32,
                              create: bool = True) -> torch.Tensor:
        """Rows of unique ``ids`` (in the given order), pulled from their PS concurrently.

        ``create=False`` (evaluation, export): rows never trained come back with
        their initial values without being stored on the PS."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        positions = self.partition_ids(ids)
        out = torch.empty((ids.shape[0], dim), dtype=dtype)

        def pull(i: int, stub: PSStub) -> None:
            pos = positions[i]
            if pos.shape[0] == 0:
                return
            req = pb.PullEmbeddingRequest(table=table, id_tensor=codec.encode_ids(ids[pos]),
                                          no_create=not create)
            _place(out, pos, codec.decode(stub.pull_embedding(req, timeout=self.rpc_timeout_s),
                                          dtype, [pos.shape[0], dim]))

        self._all(pull, "pull_embedding")
        return out

    def pull_embeddings_unique(self, tables: Sequence[tuple[str, np.ndarray, int, torch.dtype]],
                               create: bool = True) -> list[torch.Tensor]:
        """:meth:`pull_embedding_unique` of several tables ``(name, unique ids, dim,
        dtype)`` in one call per PS (concurrently): a model's lookups of one step."""
        return self.start_pull_embeddings(tables, create)()

    def start_pull_embeddings(self, tables: Sequence[tuple[str, np.ndarray, int, torch.dtype]],
                              create: bool = True) -> Callable[[], list[torch.Tensor]]:
        """:meth:`pull_embeddings_unique` under way: returns at once, and the function
        it returns waits for the rows (raising what a PS call raised)."""
        parts = []
        outs = []
        for table, ids, dim, dtype in tables:
            ids = np.ascontiguousarray(ids, dtype=np.int64)
            parts.append((table, ids, self.partition_ids(ids)))
            outs.append(torch.empty((ids.shape[0], dim), dtype=dtype))

        def pull(i: int, stub: PSStub) -> None:
            mine = [k for k, (_, _, positions) in enumerate(parts) if positions[i].shape[0]]
            if not mine:
                return
            req = pb.PullEmbeddingsRequest(tables=[
                pb.PullEmbeddingRequest(table=parts[k][0],
                                        id_tensor=codec.encode_ids(parts[k][1][parts[k][2][i]]),
                                        no_create=not create) for k in mine])
            resp = stub.pull_embeddings(req, timeout=self.rpc_timeout_s)
            if len(resp.rows) != len(mine):
                raise PSError(f"PS {i} answered {len(resp.rows)} tables of {len(mine)}")
            for k, msg in zip(mine, resp.rows):
                pos, out = parts[k][2][i], outs[k]
                _place(out, pos, codec.decode(msg, out.dtype, [pos.shape[0], out.shape[1]]))

        futures = [self.submit(i, functools.partial(pull, i), "pull_embeddings")
                   for i in range(self.num_ps)]

        def wait() -> list[torch.Tensor]:
            for f in futures:
                f.result()
            return outs

        return wait

    def export_rows(self, table: str, dim: int, dtype: torch.dtype,
                    on_rows: Callable[[np.ndarray, torch.Tensor], None],
                    max_rows: int = 0) -> int:
        """Hand every row of ``table`` that exists on the PS to ``on_rows(ids, rows)``,
        page by page (one PS after another, ids ascending per PS: a stream retried
        after a reconnect skips what was already handed over); returns the rows."""
        seen = [0]
        for ps in range(self.num_ps):
            last = [-1]

            def pages(stub: PSStub, last: list[int] = last) -> None:
                req = pb.ExportRowsRequest(table=table, max_rows=max_rows)
                for msg in stub.export_rows(req, timeout=self.rpc_timeout_s):
                    ids = codec.decode_ids(msg.id_tensor)
                    keep = ids > last[0]
                    if not keep.any():
                        continue
                    rows = codec.decode(msg.values, dtype, [ids.shape[0], dim])
                    on_rows(ids[keep], rows if keep.all() else rows[torch.from_numpy(keep)])
                    last[0] = int(ids[-1])
                    seen[0] += int(keep.sum())

            self.call(ps, pages, "export_rows")
        return seen[0]

    def pull_embedding(self, table: str, ids: Any, dim: int,
                       dtype: torch.dtype = torch.float32, create: bool = True) -> torch.Tensor:
        """Rows of ``ids`` (any shape; duplicates pulled once), shape ids.shape + (dim,)."""
        arr = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
        uniq, inverse = np.unique(arr.reshape(-1), return_inverse=True)
        rows = self.pull_embedding_unique(table, uniq, dim, dtype, create)
        return rows[torch.from_numpy(inverse.reshape(-1))].reshape(tuple(arr.shape) + (dim,))

    def push_gradients(self, ps: int, version: int, dense: Mapping[str, torch.Tensor],
                       sparse: Sequence[tuple[str, np.ndarray, torch.Tensor]] = (),
                       buffers: Optional[Mapping[str, torch.Tensor]] = None,
                       worker_id: int = 0, identity: Identity = (0, 0, 0), epoch: int = 0,
                       grad_scale: float = 1.0, discard: bool = False,
                       lr_reductions: int = 0, lr_scale: float = 1.0, sync_group: int = 0,
                       dense_into: Optional[Mapping[str, torch.Tensor]] = None) -> Future:
        """One unary push to PS ``ps``; the future gives a :class:`PushReply`
        (``(accepted, version)`` and the lr it was applied with). With ``dense_into``
        (this PS's dense parameters and buffers by name: contiguous CPU tensors) the
        PS answers with its parameters once the push is applied, decoded into them
        (``dense_version`` of the reply: theirs; the next pull of this PS is saved)."""
        task_id, minibatch, num_records = identity

        def push(stub: PSStub) -> PushReply:
            req = pb.PushGradientsRequest(
                version=version, worker_id=worker_id, task_id=task_id, minibatch=minibatch,
                num_records=num_records, epoch=epoch, lr_reductions=lr_reductions,
                lr_scale=lr_scale if lr_scale != 1.0 else 0.0, sync_group=sync_group,
                grad_scale=grad_scale if grad_scale != 1.0 else 0.0, discard=discard,
                dense=[codec.encode(g, n) for n, g in dense.items()],
                sparse=[pb.EmbeddingRows(table=t, id_tensor=codec.encode_ids(ids),
                                         values=codec.encode(g)) for t, ids, g in sparse],
                buffers=[codec.encode(b, n) for n, b in (buffers or {}).items()],
                want_dense=dense_into is not None)
            resp = stub.push_gradients(req, timeout=self.rpc_timeout_s)
            if resp.has_dense and dense_into is not None:
                _decode_dense(ps, resp, dense_into)
            return PushReply.of(resp)

        return self.submit(ps, push, "push_gradients")

    def open_push_stream(self, ps: int, version: int, worker_id: int = 0,
                         identity: Identity = (0, 0, 0), epoch: int = 0,
                         lr_reductions: int = 0, lr_scale: float = 1.0,
                         sync_group: int = 0) -> PushStream:
        return PushStream(self, ps, version, worker_id, identity, epoch, lr_reductions,
                          lr_scale, sync_group)

    def applied(self, task_ids: Sequence[int] = ()) -> list[pb.AppliedResponse]:
        """Each PS's applied-identity ledger (of ``task_ids``; empty: all)."""
        req = pb.AppliedRequest(task_ids=list(task_ids))
        return self._all(lambda i, s: s.applied(req, timeout=self.rpc_timeout_s), "applied")

    def applied_minibatches(self, task_id: int) -> tuple[dict[int, int], int]:
        """Minibatches of a task applied on *every* PS (``minibatch -> records``),
        and the oldest version among the PS answers (a task closed on every PS:
        see :meth:`task_applied`)."""
        done, version, _ = self.task_applied(task_id)
        return done, version

    def task_applied(self, task_id: int) -> tuple[dict[int, int], int, bool]:
        """:meth:`applied_minibatches` and whether the task is closed on every PS
        (the master counted it done: all its minibatches are applied). A PS where
        it is closed holds every minibatch of it."""
        return self.task_applied_at(task_id)[:3]   # type: ignore[return-value]

    def task_applied_at(self, task_id: int) -> tuple[dict[int, int], int, bool, int]:
        """:meth:`task_applied` and the oldest ledger generation among the PS answers
        (the master's rollback version each last took: a figure read before a PS
        rollback or lone restore is stale, see ``applied_short`` of the master)."""
        common: Optional[dict[int, int]] = None
        oldest = None
        generation: Optional[int] = None
        for resp in self.applied([task_id]):
            oldest = resp.version if oldest is None else min(oldest, resp.version)
            generation = resp.generation if generation is None else \
                min(generation, resp.generation)
            if task_id in IntervalSet.from_flat(list(resp.closed)):
                continue
            mine = {p.minibatch: p.num_records for p in resp.pushes}
            common = mine if common is None else \
                {mb: n for mb, n in common.items() if mb in mine}
        closed = common is None and oldest is not None
        return (common or {}, -1 if oldest is None else oldest, closed,
                -1 if generation is None else generation)

    def save_checkpoint(self) -> str:
        """Every PS writes its shard into the job's checkpoint directory (the PS's own
        configuration) under one version; returns the version directory.

        The versions of a sync job's PS can part (a worker died between its pushes
        to two PS: each applies an identity once, their counts differ by the pushes
        one of them missed). The PS behind then write their state again into the
        highest version's directory: a version's shards may hold different pushes
        (their trained-records files say which; a resume is exact per PS,
        :mod:`elasticdl.checkpoint.data_position`), never a mix of directories."""
        resps = self._all(lambda i, s: s.save_checkpoint(
            pb.SaveCheckpointRequest(), timeout=self.rpc_timeout_s), "save_checkpoint")
        top = max(r.version for r in resps)
        behind = [i for i, r in enumerate(resps) if r.version != top]
        if behind:
            logger.warning("PS versions differ %s: PS %s also write version %d",
                           [r.version for r in resps], behind, top)
            req = pb.SaveCheckpointRequest(version_at_least=top)
            again = self._all(lambda i, s: s.save_checkpoint(req, timeout=self.rpc_timeout_s),
                              "save_checkpoint", behind)
            for i, r in zip(behind, again):
                resps[i] = r
        versions = {r.version for r in resps}
        if len(versions) != 1:  # a PS moved on meanwhile (training still running)
            raise PSVersionsDifferError(f"PS saved different versions {sorted(versions)}")
        return os.path.dirname(resps[0].path)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for channel in self._channels:
            channel.close()
