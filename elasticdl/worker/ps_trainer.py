"""The worker's trainer under ParameterServerStrategy.

Per step: pull the dense parameters that changed (async mode: every
``get_model_steps`` steps; a PS whose unary push answer brought them, after the
push was applied, is not pulled again), run forward — each
:class:`~elasticdl.api.layers.Embedding` pulls only the deduplicated rows of
the batch — and backward. Gradients leave for their PS while backward still
runs: a ``post_accumulate_grad`` hook on every parameter (and on every pulled
row block) hands the gradient to that PS's push, a gRPC stream opened before
backward (for PS whose dense part is small, one unary push after backward is
cheaper and is used instead). Every PS receives exactly one push per step,
even an empty one, so sync-mode counting stays aligned.

The optimizer, its learning-rate schedule and the clipping are applied on the
PS: each push carries its task's epoch and a ``grad_scale`` (the global-norm
clip coefficient over all the step's gradients, divided by the fp16 loss
scale; see :mod:`~elasticdl.worker.ps_amp`), and each PS answers the learning
rate it applied (``last_lr``).

A push a PS rejects (sync mode, too stale) is recomputed on freshly pulled
parameters and re-sent to that PS only. A PS that restarted without a
checkpoint answers "not initialised": it gets this worker's current model
and the step is redone for it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
import zlib
from collections.abc import Collection
from typing import Any, Optional

import numpy as np
import torch

from elasticdl.api.layers import Embedding, PulledRows
from elasticdl.api.model_spec import ModelSpec
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.malloc import tune_malloc
from elasticdl.common.tables import TableSpec
from elasticdl.common.task import Task
from elasticdl.worker import ps_export
from elasticdl.worker.lookup_plan import LookupPlan
from elasticdl.worker.poller import minibatch_count
from elasticdl.worker.ps_amp import GradNorm, LossScaler, push_scale
from elasticdl.worker.ps_client import Identity, PSClient, PSNotInitializedError
from elasticdl.worker.ps_export import build_ps_model
from elasticdl.worker.ps_model_push import push_model
from elasticdl.worker.ps_push import PushSession
from elasticdl.worker.sequence_state import SequenceState
from elasticdl.worker.trainer import NonFiniteError, Trainer

logger = logging.getLogger(__name__)

KILL_AFTER_STEPS_ENV = "ELASTICDL_TEST_KILL_AFTER_STEPS"
STD_SAMPLE_ROWS = 65536   # rows a lazily re-created table's initializer std is taken over


def _kill_hook(worker_id: int) -> int:
    """Chaos tests: ``ELASTICDL_TEST_KILL_AFTER_STEPS=W:N`` makes worker W SIGKILL
    itself right after its N-th step was pushed and applied (before any report)."""
    value = os.environ.get(KILL_AFTER_STEPS_ENV, "")
    if not value:
        return -1
    worker, _, steps = value.partition(":")
    return int(steps) if int(worker) == worker_id else -1


class PSTrainer(Trainer):
    """Model replica whose parameters live on the parameter servers."""

    def __init__(self, model_spec: ModelSpec, ps_addrs: list[str], job_spec: JobSpec,
                 worker_id: int, device: torch.device, client: Optional[PSClient] = None,
                 init_timeout_s: float = 120.0, push_retry_timeout_s: float = 600.0):
        torch.manual_seed(job_spec.seed)
        tune_malloc()  # tensor-sized transfer buffers: reuse heap memory (elasticdl.common.malloc)
        self.spec = model_spec
        self.job_spec = job_spec
        self.worker_id = worker_id
        self.device = device
        self.push_retry_timeout_s = push_retry_timeout_s
        self.identity: Identity = (0, 0, 0)  # of the minibatch being trained
        self.epoch = 0                        # of the task being trained
        self.lr_reductions = 0                # its metric-driven LR reductions (master's)
        self.lr_scale = 1.0                   # its divergence-rollback LR scale (master's)
        self.sync_group = 0                   # its --divergence_sync group (master's)
        self.clip_grad_norm = float(job_spec.clip_grad_norm)
        self.amp = job_spec.amp  # autocast in the shared compute_loss (checked by PSRuntime)
        # fp16 autocast needs a loss scale; the optimizer is on the PS, so the
        # scaler lives here and the PS gets the unscaling factor with each push
        self.scaler = LossScaler() if job_spec.amp == "fp16" else None
        self._kill_after_steps = _kill_hook(worker_id)
        self.client = client or PSClient(ps_addrs)
        self.model = build_ps_model(model_spec, job_spec).to(device)
        self.model.train()
        self.sequence = SequenceState.of_spec(model_spec)
        self.init_timeout_s = init_timeout_s
        self.tables: dict[str, TableSpec] = {}
        # the weight of each materialised table as the model code left it: pushed to
        # the PS that this worker initialises, then dropped (see _initialize_ps)
        self._initial_rows: dict[str, torch.Tensor] = {}
        for name, module in self.model.named_modules():
            if isinstance(module, Embedding):
                table = f"{name}.weight" if name else "weight"
                self.tables[table] = module.table_spec(table)
                weight = module.initial_weight()
                if weight is not None:
                    self._initial_rows[table] = weight
                module.attach(self._lookup, table)
        self._declared = dict(self.tables)   # as the model declared them (for exports)
        self.params = dict(self.model.named_parameters())
        state_keys = set(self.model.state_dict())
        self.buffers = {n: b for n, b in self.model.named_buffers() if n in state_keys}
        self.owner = {n: self.client.dense_owner(n) for n in {**self.params, **self.buffers}}
        # pulls land in `mirror`: the parameters themselves on CPU, pinned copies for CUDA
        self.mirror = {n: self._mirror_of(t) for n, t in {**self.params, **self.buffers}.items()}
        sizes = [0] * self.client.num_ps
        for n, t in self.mirror.items():
            sizes[self.owner[n]] += t.numel() * t.element_size()
        self.streaming = [s > self.client.chunk_bytes for s in sizes]
        self._mirror_parts = self.client.partition(self.mirror)
        # PS whose last push answer brought their parameters (of its version): the
        # next step does not pull them (sync, or async pulling every step)
        self._fresh: set[int] = set()
        self.versions = [-1] * self.client.num_ps      # of the parameters held here
        self.ps_versions = [-1] * self.client.num_ps   # newest each PS reported
        self.steps = 0
        self._session: Optional[PushSession] = None
        self.lookups = LookupPlan()   # a step's table pulls in one call per PS
        for name, p in self.params.items():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda param, name=name: self._on_grad(name, param))
        self._initialize_ps(init_timeout_s)

    def _mirror_of(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and t.is_contiguous():
            return t.data
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")

    @property
    def model_version(self) -> int:  # type: ignore[override]
        """The newest model version the PS reported (sync: all PS agree)."""
        return max(self.ps_versions)

    def collapse_version(self) -> int:
        """The oldest PS version among the parameters held (a step trains on them)."""
        return max(0, min(self.versions))

    # ------------------------------------------------------------ set-up
    def _push_model(self, ps_list: list[int]) -> None:
        """Initialise PS ``ps_list`` with this worker's model, tables with the rows its
        model code produced; returns once each of them holds a model (this one or
        another worker's), TimeoutError after ``init_timeout_s``."""
        dense = {n: p.detach().cpu() for n, p in self.params.items()}
        buffers = {n: b.detach().cpu() for n, b in self.buffers.items()}
        version = max(0, max(self.versions))
        deadline = time.monotonic() + self.init_timeout_s
        todo = list(ps_list)
        while True:
            took = push_model(self.client, version, dense, buffers,
                              list(self.tables.values()), self._initial_rows, todo)
            logger.info("worker %d pushed its model to PS %s (taken: %s)", self.worker_id,
                        todo, took)
            status = self.client.status()
            todo = [ps for ps in todo if not status[ps].initialized]
            if not todo:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"PS {todo} still without a model {self.init_timeout_s:.0f} "
                                   "s after this worker began pushing it")
            time.sleep(0.2)  # another worker's push is under way

    def _forget_initial_rows(self) -> None:
        """Every PS holds a model: free the initial rows. A PS that later restarts
        without a checkpoint gets its tables back as lazy tables, from a normal
        initializer with the std of the initial rows (the model code cannot be
        replayed on the PS)."""
        for name, rows in self._initial_rows.items():
            spec = self.tables[name]
            # of at most STD_SAMPLE_ROWS rows spread over the table (DLRM's 4.2 M x 16
            # rows whole: 82 ms of one core at start-up; a sample: 12 ms)
            sample = rows[::max(1, rows.shape[0] // STD_SAMPLE_ROWS)]   # (rows: num x dim)
            std = float(sample.float().std()) if sample.numel() > 1 else 1.0
            self.tables[name] = dataclasses.replace(
                spec, explicit=False, initializer=f"normal:{std:.9g}",
                seed=zlib.crc32(name.encode("utf-8")))
        self._initial_rows = {}

    def _initialize_ps(self, timeout_s: float) -> None:
        """Worker 0 initialises the PS; others wait for it (and push themselves if
        it never comes, e.g. worker 0 died first)."""
        self.client.wait_ready(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [i for i, s in enumerate(self.client.status()) if not s.initialized]
            if not missing:
                break
            if self.worker_id == 0 or time.monotonic() > deadline:
                self._push_model(missing)
            else:
                time.sleep(0.2)
        self._forget_initial_rows()
        self.pull_dense()

    # ------------------------------------------------------------ pulls
    def pull_dense(self, ps_list: Optional[list[int]] = None) -> None:
        """Bring the local parameters up to the PS versions."""
        results = self.client.pull_dense(self.versions, self.mirror, self.streaming, ps_list)
        updated = set()
        for ps, (initialized, version, changed) in results.items():
            if not initialized:
                raise PSNotInitializedError(ps, f"PS {ps} lost its model")
            self.versions[ps] = version
            self.ps_versions[ps] = version
            if changed:
                updated.add(ps)
        self._install(updated)

    def _install(self, updated: Collection[int]) -> None:
        """The mirror's tensors of PS ``updated`` into the parameters and buffers (a
        copy only where the mirror is not the tensor itself: a pinned copy for CUDA)."""
        if not updated:
            return
        with torch.no_grad():
            for name, t in {**self.params, **self.buffers}.items():
                if self.owner[name] in updated and self.mirror[name] is not t.data:
                    # synchronous: the next pull reuses the (pinned) mirror
                    t.data.copy_(self.mirror[name])

    def _pull_or_reinit(self, ps_list: Optional[list[int]] = None) -> None:
        """pull_dense; a PS that lost its model (restart without checkpoint) gets ours."""
        for _ in range(self.client.num_ps + 1):
            try:
                self.pull_dense(ps_list)
                return
            except PSNotInitializedError as e:
                self._push_model([e.ps])
        self.pull_dense(ps_list)

    def dense_reply_into(self, ps: int) -> Optional[dict[str, torch.Tensor]]:
        """Where PS ``ps``'s push answer should decode its parameters (its part of the
        mirror): in lockstep sync training (a version waits for every worker's push:
        ``grads_to_wait`` >= the workers), where the answer is what the next step's pull
        would bring, and for a unary push (a streamed dense part is pulled as a stream);
        else None. With fewer pushes a version (or async) another worker's push can move
        the PS between the answer and the next step, and the pull at the step's start is
        fresher: a digits PS job with 2 workers and ``grads_to_wait=1`` ended at 0.936
        accuracy against its 0.94 bar when it trained on the answers."""
        spec = self.job_spec
        if self.streaming[ps] or spec.use_async or spec.grads_to_wait < spec.num_workers:
            return None
        return self._mirror_parts[ps]

    def _took_dense(self, ps: int, version: int) -> None:
        """PS ``ps``'s push answer brought its parameters of ``version`` (in the mirror)."""
        self.versions[ps] = version
        self.ps_versions[ps] = max(self.ps_versions[ps], version)
        self._install((ps,))
        self._fresh.add(ps)

    def _lookup(self, layer: Embedding, ids: torch.Tensor) -> PulledRows:
        """The deduplicated rows of ``ids`` (training: a leaf whose gradient is
        pushed to the rows' PS) and ``ids`` remapped to positions among them."""
        flat = ids.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        uniq, inverse = np.unique(flat, return_inverse=True)
        session = self._session  # None: evaluation or prediction (no rows created)
        rows = self.lookups.take(layer.table_name, ids, uniq, layer.embedding_dim,
                                 layer.table_dtype)
        if rows is None:
            rows = self.client.pull_embedding_unique(layer.table_name, uniq,
                                                     layer.embedding_dim, layer.table_dtype,
                                                     create=session is not None)
        rows = rows.to(self.device)
        pad = None
        if layer.padding_idx is not None:
            hit = np.searchsorted(uniq, layer.padding_idx)
            if hit < uniq.shape[0] and uniq[hit] == layer.padding_idx:
                pad = int(hit)
        if session is not None and torch.is_grad_enabled():
            rows.requires_grad_(True)
            rows.register_post_accumulate_grad_hook(
                lambda leaf: session.on_sparse(layer.table_name, uniq, leaf.grad))
        index = torch.from_numpy(inverse.reshape(ids.shape)).to(self.device)
        return PulledRows(rows, index, pad)

    # ------------------------------------------------------------ steps
    def _on_grad(self, name: str, param: torch.Tensor) -> None:
        if self._session is not None and param.grad is not None:
            self._session.on_dense(name, param.grad)

    # ------------------------------------------------------- exactly once
    def start_task(self, task: Task) -> frozenset[int]:
        """Minibatches of ``task`` every PS already applied (an earlier holder of
        the task pushed them): the task resumes after them."""
        self.epoch = task.epoch
        self.lr_reductions = int(getattr(task, "lr_reductions", 0))
        self.lr_scale = float(getattr(task, "lr_scale", 1.0))
        self.sync_group = int(getattr(task, "sync_group", 0))
        done, _, closed = self.client.task_applied(task.task_id)
        if closed:   # the master counted it done meanwhile (a straggler's copy)
            logger.info("worker %d: task %d is closed on every PS; nothing to train",
                        self.worker_id, task.task_id)
            return frozenset(range(1, minibatch_count(task.num_records,
                                                      self.job_spec.minibatch_size) + 1))
        if done:
            logger.info("worker %d: task %d resumes; minibatches %s already applied",
                        self.worker_id, task.task_id, sorted(done))
        return frozenset(done)

    def set_position(self, task_id: int, minibatch: int, num_records: int) -> None:
        self.identity = (task_id, minibatch, num_records)

    def finish_task(self, task: Task) -> dict[str, int]:
        """What the PS applied of ``task``, read back from their ledgers."""
        self.identity = (0, 0, 0)
        done, version, closed, generation = self.client.task_applied_at(task.task_id)
        applied = task.num_records if closed else sum(done.values())
        return {"records_applied": applied, "applied_at_version": version,
                "applied_generation": max(generation, 0)}

    def train_minibatch(self, features: Any, labels: Any) -> torch.Tensor:
        """One step; a push a PS rejects as stale is recomputed on fresh parameters
        and re-sent to that PS, for as long as the PS make progress (a rejection
        is others moving ahead, not a failure): it fails only after
        ``push_retry_timeout_s`` without any PS version advancing."""
        targets = list(range(self.client.num_ps))
        pull = not self.job_spec.use_async or self.sync_group > 0 or \
            self.steps % self.job_spec.get_model_steps == 0
        deadline = time.monotonic() + self.push_retry_timeout_s
        attempt = 0
        lrs: dict[int, float] = {}
        while True:
            attempt += 1
            before = list(self.ps_versions)
            stale = [ps for ps in range(self.client.num_ps)
                     if attempt > 1 or ps not in self._fresh]
            self._fresh.clear()
            if (pull or attempt > 1) and stale:
                # the step's table rows come in while the dense parameters do
                self.lookups.prefetch(features, self.client, create=True)
                try:
                    self._pull_or_reinit(stale)
                except BaseException:
                    self.lookups.end_step()   # (rows pulled before a failure: dropped)
                    raise
            try:
                loss, results = self._step(features, labels, targets)
            except PSNotInitializedError as e:  # an embedding pull met a restarted PS
                self._push_model([e.ps])
                continue
            retry = []
            for ps, result in results.items():
                if isinstance(result, PSNotInitializedError):
                    self._push_model([ps])
                    retry.append(ps)
                    continue
                accepted, version = result
                self.ps_versions[ps] = version
                if not accepted:
                    retry.append(ps)
                else:
                    lrs[ps] = result.learning_rate
                    if result.dense_version >= 0:
                        self._took_dense(ps, result.dense_version)
            if not retry:
                self.steps += 1
                self.last_lr = lrs[min(lrs)] if lrs else self.last_lr
                if self.steps == self._kill_after_steps:  # test hook: die before the report
                    logger.warning("worker %d: %s: SIGKILL after step %d", self.worker_id,
                                   KILL_AFTER_STEPS_ENV, self.steps)
                    os.kill(os.getpid(), signal.SIGKILL)
                return loss
            if self.ps_versions != before:
                deadline = time.monotonic() + self.push_retry_timeout_s
            elif time.monotonic() > deadline:
                raise RuntimeError(f"step not accepted by PS {retry} and no PS made progress "
                                   f"for {self.push_retry_timeout_s:.0f} s")
            logger.info("worker %d: step redone for PS %s (attempt %d)", self.worker_id,
                        retry, attempt)
            if attempt > 3:
                time.sleep(min(0.1, 0.005 * attempt))
            targets = retry

    def _step(self, features: Any, labels: Any,
              targets: list[int]) -> tuple[torch.Tensor, dict[int, Any]]:
        self.model.zero_grad(set_to_none=True)
        norm = GradNorm(float64=self.scaler is not None) \
            if self.clip_grad_norm > 0 or self.scaler is not None else None
        session = PushSession(self, targets, self.epoch, norm, self.lr_reductions,
                              self.lr_scale, self.sync_group)
        self._session = session
        try:
            if not self.lookups.started:
                self.lookups.prefetch(features, self.client, create=True)
            loss = self.compute_loss(features, labels)
            (loss * self.scaler.scale if self.scaler is not None else loss).backward()
            grad_scale, discard = push_scale(norm, self.clip_grad_norm, self.scaler)
        except FloatingPointError as e:
            session.abort()
            raise NonFiniteError(f"{e}: cannot clip to --clip_grad_norm="
                                 f"{self.clip_grad_norm}") from None
        except BaseException:
            session.abort()
            raise
        finally:
            self._session = None
            self.lookups.end_step()
        if discard:
            logger.warning("worker %d: fp16 gradients overflowed; step skipped, loss scale "
                           "now %g", self.worker_id, self.scaler.scale if self.scaler else 0)
        return loss.detach(), session.finish(self.buffers, grad_scale, discard)

    def forward(self, features: Any) -> Any:
        """Outputs with the newest parameters (evaluation and prediction)."""
        try:
            self.lookups.prefetch(features, self.client, create=False)
            self._pull_or_reinit()
            return super().forward(features)
        finally:
            self.lookups.end_step()

    # ------------------------------------------------------------ export
    def sparse_tables(self) -> list[str]:
        """Tables exported as their rows that exist (:func:`ps_export.sparse_tables`)."""
        return ps_export.sparse_tables(self._declared, self.job_spec)

    def state_dict_from_ps(self, batch_ids: int = 1 << 20,
                           skip: Collection[str] = ()) -> dict[str, torch.Tensor]:
        """The model's plain state dict with the PS's newest values; embedding
        tables (but ``skip``) whole (rows never trained hold their initial values)."""
        self.versions = [-1] * self.client.num_ps  # force a full pull
        self._pull_or_reinit()
        return ps_export.state_dict(self.model, self.client, self.tables, batch_ids, skip)

    def export_model(self, directory: str) -> list[str]:
        """``model.pt`` as the Local strategy writes it and the big tables as their rows
        that exist (:func:`ps_export.export_model`); returns the paths."""
        sparse = self.sparse_tables()
        state = self.state_dict_from_ps(skip=sparse)
        own = self.model if self.device.type == "cpu" else None   # (else built on the CPU)
        return ps_export.export_model(self.spec, self.job_spec, self.client, self._declared,
                                      sparse, directory, state, own)

    def save_checkpoint(self) -> str:
        """Every PS writes its shard of its current version into the job's checkpoint
        directory; returns the version dir."""
        return self.client.save_checkpoint()

    def close(self) -> None:
        lk = self.lookups
        if lk.prefetched:
            logger.info("worker %d: table lookups served from the plan: %d pulled ahead; %d "
                        "hits, %d misses", self.worker_id, lk.prefetched, lk.hits, lk.misses)
        self.client.close()
