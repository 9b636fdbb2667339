"""One training step's gradient pushes from a worker to its parameter servers.

:class:`PushSession` takes each gradient from the autograd hooks as backward
produces it and routes it to its PS: into that PS's open
:class:`~elasticdl.worker.ps_stream.PushStream`, or, for PS whose dense part is
small, into one unary push sent after backward. :func:`stage` makes the CPU
copy (asynchronous for CUDA tensors). With clipping or fp16 loss scaling a
:class:`~elasticdl.worker.ps_amp.GradNorm` takes every gradient's norm from
the same hooks (all of them, also on a retry to some PS only), and the push's
``grad_scale`` (or ``discard``) goes with its last message.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Optional, Protocol

import numpy as np
import torch

from elasticdl.worker.ps_amp import GradNorm
from elasticdl.worker.ps_client import PSClient, PSNotInitializedError
from elasticdl.worker.ps_stream import Identity

logger = logging.getLogger(__name__)

Staged = tuple[torch.Tensor, Optional[Callable[[], None]]]
_warned_sparse: set[str] = set()


def dense_gradient(name: str, grad: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of a dense parameter (a module's own ``sparse=True``
    lookup into it that was not made a PS table) as the dense gradient it stands
    for: the push carries dense tensors, and the PS applies what torch's optimizer
    would apply to ``grad.to_dense()``. Warned once per parameter (it costs the
    whole parameter's bytes)."""
    if not grad.is_sparse:
        return grad
    if name not in _warned_sparse:
        _warned_sparse.add(name)
        logger.warning("parameter %r has a sparse gradient: pushed dense (%d elements); "
                       "an nn.Embedding/nn.EmbeddingBag becomes a PS table instead (see "
                       "--ps_table_min_elements)", name, grad.numel())
    return grad.coalesce().to_dense()


def stage(t: torch.Tensor) -> Staged:
    """A CPU copy of a gradient: asynchronous (pinned + event) for CUDA tensors."""
    if t.device.type != "cuda":
        return t.detach(), None
    cpu = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    cpu.copy_(t.detach(), non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return cpu, event.synchronize



class PushingTrainer(Protocol):
    """What a :class:`PushSession` reads of its trainer
    (:class:`~elasticdl.worker.ps_trainer.PSTrainer`)."""

    client: PSClient
    identity: Identity      # of the minibatch being trained
    owner: dict[str, int]   # PS of each dense parameter and buffer
    versions: list[int]     # of the parameters held, per PS
    streaming: list[bool]   # per PS: push through a stream
    worker_id: int

    def dense_reply_into(self, ps: int) -> Optional[dict[str, torch.Tensor]]:
        """Where PS ``ps``'s push answer decodes its parameters (None: not wanted)."""


class PushSession:
    """One step's gradient pushes to the PS in ``targets``."""

    def __init__(self, trainer: PushingTrainer, targets: list[int], epoch: int = 0,
                 norm: Optional[GradNorm] = None, lr_reductions: int = 0,
                 lr_scale: float = 1.0, sync_group: int = 0):
        self.t = trainer
        self.targets = set(targets)
        self.epoch = epoch
        self.lr_reductions = lr_reductions
        self.lr_scale = lr_scale
        self.sync_group = sync_group
        self.norm = norm
        self.streams = {i: trainer.client.open_push_stream(i, trainer.versions[i],
                                                           trainer.worker_id, trainer.identity,
                                                           epoch, lr_reductions, lr_scale,
                                                           sync_group)
                        for i in targets if trainer.streaming[i]}
        self.dense: dict[int, dict[str, torch.Tensor]] = {i: {} for i in targets}
        self.sparse: dict[int, list[tuple[str, np.ndarray, torch.Tensor]]] = \
            {i: [] for i in targets}
        self.waits: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def on_dense(self, name: str, grad: torch.Tensor) -> None:
        grad = dense_gradient(name, grad)
        if self.norm is not None:
            self.norm.add_dense(grad)
        ps = self.t.owner[name]
        if ps not in self.targets:
            return
        staged, ready = stage(grad)
        if ps in self.streams:
            self.streams[ps].put_dense(name, staged, ready)
            return
        with self._lock:
            self.dense[ps][name] = staged
            if ready is not None:
                self.waits.append(ready)

    def on_sparse(self, table: str, ids: np.ndarray, grad: torch.Tensor) -> None:
        if self.norm is not None:
            self.norm.add_rows(table, ids, grad)
        staged, ready = stage(grad)
        parts = [(ps, pos) for ps, pos in enumerate(self.t.client.partition_ids(ids))
                 if ps in self.targets and pos.shape[0]]
        if len(parts) > 1 and ready is not None:
            ready()  # rows are split on the CPU: the copy must be complete first
            ready = None
        for ps, pos in parts:
            part = staged if pos.shape[0] == ids.shape[0] else \
                staged.index_select(0, torch.from_numpy(pos))
            if ps in self.streams:
                self.streams[ps].put_sparse(table, ids[pos], part, ready)
            else:
                with self._lock:
                    self.sparse[ps].append((table, ids[pos], part))
                    if ready is not None:
                        self.waits.append(ready)

    def abort(self) -> None:
        for stream in self.streams.values():
            stream.abort()

    def finish(self, buffers: dict[str, torch.Tensor], grad_scale: float = 1.0,
               discard: bool = False) -> dict[int, Any]:
        """Send what is left, every PS's part times ``grad_scale`` (nothing of it
        when ``discard``); per PS a :class:`~elasticdl.worker.ps_stream.PushReply`
        or the exception raised."""
        for wait in self.waits:
            wait()
        parts = self.t.client.partition({n: b.detach().cpu() for n, b in buffers.items()})
        futures = {}
        for ps in self.targets:
            if ps in self.streams:
                for name, value in parts[ps].items():
                    self.streams[ps].put_buffer(name, value)
                self.streams[ps].close(grad_scale, discard)
            else:
                dense, sparse = ({}, []) if discard else (self.dense[ps], self.sparse[ps])
                futures[ps] = self.t.client.push_gradients(
                    ps, self.t.versions[ps], dense, sparse, parts[ps],
                    self.t.worker_id, self.t.identity, self.epoch, grad_scale, discard,
                    self.lr_reductions, self.lr_scale, self.sync_group,
                    dense_into=self.t.dense_reply_into(ps))
        out: dict[int, Any] = {}
        for ps in self.targets:
            try:
                out[ps] = self.streams[ps].finish() if ps in self.streams \
                    else futures[ps].result()
            except PSNotInitializedError as e:
                out[ps] = e
        return out
