"""``push_model`` on the PS: taking the model a worker pushes, in one message or several.

A model whose embedding tables come with their initial rows (the weight the
user's model code produced, see :class:`elasticdl.api.layers.Embedding`) is too
big for one message: the worker sends part 0 (version, dense parameters,
buffers, table declarations), then parts carrying the rows as ``TensorChunk`` s
of a few MiB, all under one random ``init_id``. The PS assembles them into
per-table tensors (straight into their final memory) and takes the model only
at the last part, all or nothing.

Exactly one push wins: while a push is being assembled, parts of another
``init_id`` answer "not taken" (``accepted=False``); a push whose sender went
silent for ``stale_after_s`` (it died mid-push) is discarded and the next
part 0 starts over. Once the PS holds a model every push answers "not taken".
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from elasticdl.common import tensor_codec as codec
from elasticdl.common.tables import TableSpec, local_rows
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.ps.shard import PSShard

logger = logging.getLogger(__name__)

MAX_VERSION = (1 << 53) - 1
MAX_TENSORS = 100_000
MAX_TABLE_DIM = 1 << 16
MAX_PARTS = 1 << 24
MAX_PUSHED_ROWS_BYTES = 4 << 30   # initial rows one PS accepts in one push (all tables)


def _check_range(what: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"{what} must be in [{low}, {high}], got {value}")


@dataclass
class _Pending:
    init_id: int
    version: int
    dense: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    tables: list[TableSpec]
    rows: dict[str, torch.Tensor]          # table -> this PS's rows, being filled
    assembler: codec.ChunkAssembler
    next_part: int = 1
    seen: float = field(default_factory=time.monotonic)


class ModelPushes:
    """Assembles pushed models for one PS shard."""

    def __init__(self, shard: PSShard, stale_after_s: float = 30.0):
        self.shard = shard
        self.stale_after_s = stale_after_s
        self._lock = threading.Lock()
        self._pending: Optional[_Pending] = None

    def push(self, request: pb.Model) -> bool:
        """Take one message of a push; True when it was taken (a non-final part:
        keep sending; the final part or a single message: the PS took the model).

        Raises:
            ValueError: malformed message (INVALID_ARGUMENT); the push in progress
                is dropped.
        """
        if self.shard.initialized:
            return False
        if request.init_id == 0:  # the whole model in one message
            pending = self._start(request)
            return self._finish(pending)
        with self._lock:
            if self.shard.initialized:
                return False
            current = self._pending
            now = time.monotonic()
            if current is not None and current.init_id != request.init_id:
                if request.part != 0 or now - current.seen < self.stale_after_s:
                    return False  # another worker is pushing (or took over from this one)
                logger.warning("PS %d: push_model %x went silent for %.0f s; discarded",
                               self.shard.config.ps_id, current.init_id, now - current.seen)
                self._pending = current = None
            if request.part == 0:
                if current is not None:  # the same init_id: a resend, or a bad sender
                    if current.next_part == 1:
                        return True
                    raise ValueError(f"push_model {request.init_id:x}: part 0 sent again "
                                     f"after part {current.next_part - 1}")
                current = self._pending = self._start(request)
            elif current is None:
                return False  # its start was discarded as stale: the sender starts over
            elif request.part == current.next_part - 1:
                current.seen = now
                return True  # a part resent after its answer was lost: already taken
            else:
                try:
                    self._add(current, request)
                except ValueError:
                    self._pending = None
                    raise
            current.seen = now
            if not request.last:
                return True
            self._pending = None
        return self._finish(current)

    # ------------------------------------------------------------ parts
    def _start(self, request: pb.Model) -> _Pending:
        cfg = self.shard.config
        _check_range("version", request.version, 0, MAX_VERSION)
        n = len(request.dense) + len(request.buffers) + len(request.embedding_tables)
        _check_range("number of tensors and tables", n, 0, MAX_TENSORS)
        dense = {t.name: codec.decode(t) for t in request.dense}
        buffers = {t.name: codec.decode(t) for t in request.buffers}
        if len(dense) != len(request.dense) or len(buffers) != len(request.buffers):
            raise ValueError("push_model: duplicate tensor names")
        if not all(name for name in list(dense) + list(buffers)):
            raise ValueError("push_model: a tensor without a name")
        tables = []
        rows: dict[str, torch.Tensor] = {}
        explicit_bytes = 0
        for t in request.embedding_tables:
            _check_range(f"table {t.name!r} dim", t.dim, 1, MAX_TABLE_DIM)
            _check_range(f"table {t.name!r} num_embeddings", t.num_embeddings, 1, 1 << 48)
            spec = TableSpec(name=t.name, num_embeddings=t.num_embeddings, dim=t.dim,
                             initializer=t.initializer or "normal", seed=t.seed,
                             padding_idx=t.padding_idx,
                             dtype=codec.torch_dtype(t.dtype or "float32"),
                             explicit=t.rows_pushed,
                             admit_after=t.admit_after if t.HasField("admit_after") else None,
                             ttl_versions=t.ttl_versions if t.HasField("ttl_versions")
                             else None,
                             max_rows=t.max_rows if t.HasField("max_rows") else None,
                             ttl_seconds=t.ttl_seconds if t.HasField("ttl_seconds")
                             else None)
            if spec.explicit:
                local = local_rows(spec.num_embeddings, cfg.ps_id, cfg.num_ps)
                explicit_bytes += local * spec.dim * spec.dtype.itemsize
                if explicit_bytes > MAX_PUSHED_ROWS_BYTES:
                    raise ValueError(f"table {spec.name!r}: initial rows of more than "
                                     f"{MAX_PUSHED_ROWS_BYTES >> 30} GiB per PS; give large "
                                     "tables an initializer (lazy tables)")
                rows[spec.name] = torch.empty((local, spec.dim), dtype=spec.dtype)
            tables.append(spec)
        pending = _Pending(request.init_id, request.version, dense, buffers, tables, rows,
                           codec.ChunkAssembler(destinations=rows))
        self._add(pending, request, first=True)
        return pending

    def _add(self, pending: _Pending, request: pb.Model, first: bool = False) -> None:
        if not first:
            if request.part != pending.next_part:
                raise ValueError(f"push_model {pending.init_id:x}: part {request.part}, "
                                 f"expected {pending.next_part}")
            if request.dense or request.buffers or request.embedding_tables:
                raise ValueError(f"push_model {pending.init_id:x}: only part 0 carries "
                                 "dense tensors, buffers and tables")
            _check_range("part", request.part, 1, MAX_PARTS)
            pending.next_part += 1
        for chunk in request.table_rows:
            pending.assembler.add(chunk)

    def _finish(self, pending: _Pending) -> bool:
        missing = [n for n in pending.rows if not pending.assembler.complete(n)]
        if missing:
            raise ValueError(f"push_model: initial rows of table(s) {missing} incomplete at "
                             "the last part")
        tables = [replace(t, rows=pending.rows[t.name]) if t.explicit else t
                  for t in pending.tables]
        taken = self.shard.initialize(pending.version, pending.dense, pending.buffers, tables)
        if taken and self.shard.on_model_pushed is not None:
            with self.shard.lock:
                self.shard.on_model_pushed(self.shard)
        if taken and pending.rows:
            logger.info("PS %d took initial rows of %d table(s) (%.1f MB)",
                        self.shard.config.ps_id, len(pending.rows),
                        sum(r.numel() * r.element_size() for r in pending.rows.values()) / 1e6)
        return taken
