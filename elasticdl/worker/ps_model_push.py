"""The worker's side of ``push_model``: the model, and the initial rows of its
materialised embedding tables, to each PS in messages of a few MiB.

Each PS gets its dense parameters and buffers (placed by name), every table's
declaration and, for tables whose rows are given (``TableSpec.explicit``), its
part of the rows (ids ``ps_id, ps_id + num_ps, ...``) as ``TensorChunk`` s.
Without such tables the model goes in one message, as before. See
:mod:`elasticdl.ps.model_push` for the PS's side.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

from elasticdl.common import tensor_codec as codec
from elasticdl.common.tables import TableSpec
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.worker.ps_client import PSClient, table_info


def _row_chunks(rows: Mapping[str, torch.Tensor], ps: int, num_ps: int,
                chunk_bytes: int) -> Iterator[pb.TensorChunk]:
    for name, weight in rows.items():
        part = weight.detach()[ps::num_ps].to("cpu").contiguous()  # this PS's rows, in order
        yield from codec.iter_chunks(name, part, chunk_bytes)


def model_messages(version: int, dense: Mapping[str, torch.Tensor],
                   buffers: Mapping[str, torch.Tensor], tables: Sequence[TableSpec],
                   rows: Mapping[str, torch.Tensor], ps: int, num_ps: int,
                   chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES) -> Iterator[pb.Model]:
    """The messages of one push to PS ``ps`` (``dense``/``buffers``: that PS's part;
    ``rows``: the whole initial weight of each explicit table)."""
    missing = [t.name for t in tables if t.explicit and t.name not in rows]
    if missing:
        raise ValueError(f"push_model: no initial rows for explicit table(s) {missing}")
    head = pb.Model(version=version, embedding_tables=[table_info(t) for t in tables],
                    dense=[codec.encode(t, n) for n, t in dense.items()],
                    buffers=[codec.encode(t, n) for n, t in buffers.items()])
    explicit = {t.name: rows[t.name] for t in tables if t.explicit}
    if not explicit:
        yield head
        return
    head.init_id = random.SystemRandom().randrange(1, 1 << 62)
    pending: Optional[pb.Model] = head
    size = 0
    part = 0
    for chunk in _row_chunks(explicit, ps, num_ps, chunk_bytes):
        assert pending is not None
        if size and size + len(chunk.content) > chunk_bytes:
            yield pending
            part += 1
            pending, size = pb.Model(init_id=head.init_id, part=part), 0
        pending.table_rows.append(chunk)
        size += len(chunk.content)
    assert pending is not None
    pending.last = True
    yield pending


def push_model(client: PSClient, version: int, dense: Mapping[str, torch.Tensor],
               buffers: Mapping[str, torch.Tensor], tables: Sequence[TableSpec],
               rows: Mapping[str, torch.Tensor], ps_list: Optional[Sequence[int]] = None
               ) -> list[bool]:
    """Push to each PS of ``ps_list`` (all by default) concurrently; per PS whether it
    took this model (False: it already had one, or another worker's push is under way)."""
    dparts, bparts = client.partition(dense), client.partition(buffers)
    targets = list(range(client.num_ps)) if ps_list is None else list(ps_list)

    def send(msg: pb.Model, stub: Any) -> bool:
        return bool(stub.push_model(msg, timeout=client.rpc_timeout_s).accepted)

    def push(ps: int) -> bool:
        for msg in model_messages(version, dparts[ps], bparts[ps], tables, rows, ps,
                                  client.num_ps, client.chunk_bytes):
            if not client.call(ps, functools.partial(send, msg), "push_model"):
                return False
        return True

    with ThreadPoolExecutor(max_workers=max(1, len(targets)),
                            thread_name_prefix="push-model") as pool:
        futures = [pool.submit(push, ps) for ps in targets]
        return [f.result() for f in futures]
