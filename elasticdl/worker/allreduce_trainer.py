"""``--distribution_strategy=AllreduceStrategy``: elastic synchronous data parallelism.

:class:`AllreduceTrainer` keeps a full model replica, forms a torch.distributed
group from the master's rendezvous plans (gloo on CPU, NCCL on CUDA,
``--comm_backend`` to override; timeouts of ``--collective_timeout_s``) and
averages gradients with bucketed all-reduce started from backward hooks
(:mod:`elasticdl.elastic.grad_sync`), overlapping communication with backward. All
membership handling — detecting a dead member, re-rendezvous without restarting
the process, broadcasting model/optimizer/counters from the most advanced
survivor, retrying the step, admitting new workers — is the one retry loop of
:class:`elasticdl.elastic.runner.ElasticRunner`, the same one custom
``train_loop(ctx)`` modules use.

Why our own hooks rather than torch DDP: DDP builds its reducer for one process
group and broadcasts from rank 0 at construction, so every membership change
would rebuild it, and it offers no way to exchange the per-step meta (records,
plan change, leaving) or to weight members by their records (idle members,
short last batches, ``--fixed_global_batch_size`` accumulation) without an extra
pass. A first version exchanged the meta in a blocking header collective before
each step and measured 3-5% slower than DDP on a loaded 2-core machine (one
more waiting point per step); with the meta all-reduce launched asynchronously
at the start of the step the two are at parity: MNIST CNN, batch 64, 2 gloo
processes, ``benchmarks/allreduce_step.py``: ratios 0.985-1.046, median of
per-block ratios 0.99-1.00.

Driving it: call :meth:`AllreduceTrainer.run` (not the generic ``TaskLoop``):
it iterates an :class:`~elasticdl.worker.elastic_dataset.ElasticDataset`, which joins
idle rounds while the master says WAIT (instead of sleeping while peers wait in a
collective), reports a task only once its steps are confirmed on every member,
and runs evaluation/prediction tasks with the shared ``TaskLoop.run_task``.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from elasticdl.api.model_spec import ModelSpec
from elasticdl.checkpoint import api as ckpt
from elasticdl.checkpoint import data_position
from elasticdl.common.collective import guard
from elasticdl.common.intervals import IntervalSet
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.schedule import Schedule
from elasticdl.common.task import Task, TaskType
from elasticdl.data.api import DataError, DataReader
from elasticdl.elastic.group import CommClient, ElasticGroup, default_backend
from elasticdl.elastic.runner import (
    ElasticRunner,
    ElasticState,
    RoundResult,
    RoundStatus,
    StepAborted,
)
from elasticdl.elastic.trained import TrainedRecords
from elasticdl.worker.elastic_dataset import ElasticDataset, ElasticLoopContext
from elasticdl.worker.minibatches import TaskRecords
from elasticdl.worker.poller import TaskPoller
from elasticdl.worker.prediction import PredictionSink
from elasticdl.worker.task_loop import LoopStats, TaskLoop
from elasticdl.worker.task_source import TaskSource
from elasticdl.worker.trainer import LocalTrainer, Trainer, batch_size_of

logger = logging.getLogger(__name__)

__all__ = ["AllreduceTrainer", "CommClient", "StepAborted"]

OnStep = Callable[[int, Optional[torch.Tensor]], None]


class AllreduceTrainer(Trainer):
    """One member of an elastic allreduce group (see the module docs).

    Args:
        model_spec: the user's model module.
        job_spec: flags (``comm_backend``, ``collective_timeout_s``,
            ``fixed_global_batch_size``, ``num_workers``, ``seed``, checkpoints).
        worker_id: this worker's id (the master knows it by this id).
        device: where the model lives.
        comm: the master's rendezvous (:class:`CommClient`).
        host: the address peers reach this worker on (sent with ``join``).
        port: sent with ``join`` for the plan's peer list (informational).
        rendezvous_timeout_s: longest wait for a plan that includes this worker.
    """

    def __init__(self, model_spec: ModelSpec, job_spec: JobSpec, worker_id: int,
                 device: torch.device, comm: CommClient, host: str, port: int = 0,
                 rendezvous_timeout_s: float = 600.0):
        self.spec = model_spec
        self.job_spec = job_spec
        self.worker_id = worker_id
        self.device = device
        if model_spec.train_loop is not None and job_spec.amp == "fp16":
            raise ValueError(f"--amp=fp16 is not applied to the custom train_loop of "
                             f"{model_spec.module_path}: use torch.autocast and a GradScaler "
                             "in the loop, or --amp=bf16 (ctx.autocast())")
        local = LocalTrainer(model_spec, device, job_spec.seed, amp=job_spec.amp,
                             clip_grad_norm=job_spec.clip_grad_norm)
        self.model = local.model
        self.optimizer = local.optimizer
        self.amp = job_spec.amp
        self._compute_loss = local.compute_loss
        self._local = local   # its compute_loss watches for a collapse: at our versions
        local.collapse_version = lambda: self.state.model_version  # type: ignore[method-assign]
        # scheduler, its epoch, GradScaler: stepped in optimizer.step() once the step's
        # gradients are averaged (the same on every member), broadcast with the state
        self.extras = local.extras
        self.state = ElasticState(self.model, self.optimizer)
        self.state.register("optimizer_extras", self.extras)
        # the minibatches of every member in the model (exchanged with each step's meta):
        # re-queued tasks skip them, checkpoints record them as their data position
        self.trained = TrainedRecords(job_spec.minibatch_size)
        self.state.register("trained_records", self.trained)
        self.schedule = Schedule.from_spec(job_spec)
        backend = default_backend(device, job_spec.comm_backend)
        self.group = ElasticGroup(comm, host, backend, device, job_spec.collective_timeout_s,
                                  port=port, rendezvous_timeout_s=rendezvous_timeout_s)
        micro = job_spec.num_workers if job_spec.fixed_global_batch_size else 0
        self.runner = ElasticRunner(self.state, self.group, device, global_microbatches=micro,
                                    on_lost=self._count_lost, on_round=self._after_round,
                                    trained=self.trained)
        self.runner.step_fn = self._step
        self.runner.before_step = self._before_step
        self.runner.after_step = self._after_step
        self._dataset: Optional[ElasticDataset] = None
        self._lost = 0
        self._on_step: Sequence[OnStep] = ()
        self.last_loss: Optional[torch.Tensor] = None

    # ------------------------------------------------------------- Trainer
    @property  # type: ignore[override]
    def model_version(self) -> int:
        return self.state.model_version

    @model_version.setter
    def model_version(self, value: int) -> None:
        self.state.model_version = int(value)

    def collapse_counters(self) -> dict[str, int]:
        return self._local.collapse_counters()

    def _step(self, features: Any, labels: Any) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._compute_loss(features, labels)
        scaler = self.extras.scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()
        self.optimizer.step()   # gated: reduce, _before_step, update, _after_step
        return loss.detach()

    def _before_step(self) -> bool:
        """In ``optimizer.step()`` after the gradients were averaged (identical on
        every member): step an epoch scheduler at the step's agreed epoch, unscale
        (``--amp=fp16``; the members agree on skipping), clip the global norm.
        Returns False when the update is skipped (inf/nan under the GradScaler)."""
        epoch = self.runner.step_epoch
        if epoch >= 0:
            self.extras.advance_epoch(epoch)
        self.extras.catch_up_reductions(self.runner.step_lr_reductions)
        apply = True
        scaler = self.extras.scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
            apply = not self._agree_found_inf(scaler)
        if apply:
            self.extras.clip(self.model.parameters())
        self.last_lr = float(self.optimizer.param_groups[0]["lr"])
        return apply

    def _agree_found_inf(self, scaler: Any) -> bool:
        """All-reduce (MAX) the GradScaler's inf/nan flags so every member skips the
        same steps and updates its scale alike."""
        found = scaler._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"]
        flag = torch.zeros(1, dtype=torch.float32, device=self.device)
        for v in found.values():
            flag = torch.maximum(flag, v.to(self.device, torch.float32).reshape(1))
        with guard("all_reduce (GradScaler found-inf)"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        for v in found.values():
            v.fill_(float(flag.item()))
        return bool(flag.item() > 0)

    def _after_step(self, applied: bool) -> None:
        if self.extras.scaler is not None:
            self.extras.scaler.update()
        self.extras.after_update()

    def train_minibatch(self, features: Any, labels: Any) -> Optional[torch.Tensor]:  # type: ignore[override]
        """One minibatch through the group (plain-Trainer path; :meth:`run` is preferred).

        Returns the loss once the step ran (after retries through membership
        changes), None while accumulating (``--fixed_global_batch_size``) or when
        the step took effect on another member before a failure.

        Raises:
            StepAborted: this worker had to re-join and minibatches it trained
                since the last confirmation are lost; train them again.
        """
        result = self.runner.submit(self._step, (features, labels),
                                    batch_size_of(labels, features))
        if self._lost:
            lost, self._lost = self._lost, 0
            raise StepAborted(lost)
        return result.outputs[-1] if result is not None and result.outputs else None

    def _count_lost(self, tags: list[Any]) -> None:
        self._lost += len(tags)

    def _after_round(self, result: RoundResult) -> None:
        if result.status != RoundStatus.STEPPED:
            return
        loss = result.outputs[-1] if result.outputs else None
        if loss is not None:
            self.last_loss = loss
        if self._dataset is not None and result.outputs:
            self._dataset.record_step(result.tags, result.outputs, self.last_lr)
        version = result.version
        # every member decides alike: the same versions and the same last_saved
        # (broadcast with the state); a round counted after a failure (recovered) was
        # checkpointed (if due) by the member whose state was adopted
        if not result.recovered and self.schedule.checkpoint_due(version,
                                                                 self.trained.last_saved):
            self._checkpoint(version)
        for cb in self._on_step:
            cb(version, loss)

    def _checkpoint(self, version: int) -> None:
        """Rank 0 writes the checkpoint of ``version`` and the minibatches of every
        member its model holds (``trained-group.json``, the data position: every
        member knows them, :mod:`elasticdl.elastic.trained`)."""
        self.trained.last_saved = version
        if self.group.rank != 0:
            return
        js = self.job_spec
        self._write_trained(ckpt.version_dir(js.checkpoint_dir, version))
        ckpt.save(js.checkpoint_dir, version, self.state_dict(), js.keep_checkpoint_max)

    def save_final_checkpoint(self, closed: Optional[tuple[int, Sequence[int]]] = None
                              ) -> Optional[str]:
        """The exporting member (any rank: training is over, every member holds the
        same model and knows every member's trained records) writes the final
        model's checkpoint, unless the periodic rule wrote that version already.

        ``closed``: the master's closed tasks sent with the export order. The sets
        that come with training tasks are snapshots up to a second old, so a member
        may end training knowing few or none of them (a job of a few seconds: every
        task handed out within one snapshot). Its entries still hold every step
        (a task leaves them only once known closed), so such a position resumes
        exactly, but it is not compact; settled here, the final checkpoint records
        every closed task as an interval and only the entries of the others (none,
        training being over). A periodic checkpoint of the final version gets its
        data position rewritten (atomically, the same minibatches)."""
        js, version = self.job_spec, self.state.model_version
        if not js.checkpoint_dir:
            return None
        if closed is not None:
            self.trained.settle(int(closed[0]), IntervalSet.from_flat(list(closed[1])))
        vdir = ckpt.version_dir(js.checkpoint_dir, version)
        if version in ckpt.complete_versions(js.checkpoint_dir):
            if closed is not None:
                self._write_trained(vdir)
            return vdir
        self.trained.last_saved = version
        self._write_trained(vdir)
        ckpt.save(js.checkpoint_dir, version, self.state_dict(), js.keep_checkpoint_max)
        return vdir

    def _write_trained(self, vdir: str) -> None:
        # compact: the closed tasks as intervals + live entries (entries alone would
        # leave out every closed task: a resume would train them again)
        trained = self.trained
        data_position.write_trained_compact(vdir, "group", trained.generation, trained.closed,
                                            trained.entries())

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "model_version": self.state.model_version, "counters": dict(self.state.counters),
                "trained_records": self.trained.state_dict(),
                "extras": self.extras.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume (e.g. ``--checkpoint_dir_for_init``) before :meth:`run`; the most
        advanced member's state is broadcast when the group forms."""
        self.model.load_state_dict(state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.state.model_version = int(state.get("model_version", 0))
        self.state.counters.update(state.get("counters", {}))
        self.trained.load_state_dict(state.get("trained_records",
                                               {"last_saved": self.state.model_version}))
        if "extras" in state:
            self.extras.load_state_dict(state["extras"])

    def close(self) -> None:
        """Leave the group (idempotent)."""
        self.runner.close()

    # ---------------------------------------------------------------- loop
    def run(self, source: TaskSource, readers: dict[TaskType, DataReader],
            prediction_sink: Optional[PredictionSink] = None,
            on_step: Sequence[OnStep] = (), wait_s: float = 0.2) -> LoopStats:
        """Train on the master's tasks until it has none left, then serve the
        remaining evaluation/prediction tasks. Uses the model module's
        ``train_loop(ctx)`` when it defines one.

        Args:
            on_step: called as ``cb(model_version, loss)`` after every step
                (``loss`` is None when the step came from another member).
        """
        self._on_step = list(on_step)
        loop = TaskLoop(source, self, self.spec, readers, self.job_spec.minibatch_size,
                        worker_id=self.worker_id, prediction_sink=prediction_sink,
                        wait_s=wait_s, eval_minibatch_size=self.job_spec.eval_minibatch_size)

        def fatal(task: Task, e: DataError) -> None:
            # bad data is fatal (retrying cannot help): the master fails the job at
            # this report, as in PS mode, instead of relaunching workers that fail again
            logger.error("task %d: bad data: %s", task.task_id, e)
            source.report_task(task, str(e), traceback.format_exc(), fatal=True)

        def read(task: Task) -> TaskRecords:
            try:
                reader = readers.get(TaskType.TRAINING)
                if reader is None:
                    raise DataError(f"no training data configured for task {task.task_id}")
                return TaskRecords(reader, task, "training", self.job_spec.minibatch_size,
                                   self.spec.feed_batch)
            except DataError as e:
                fatal(task, e)
                raise

        def feed(records: Sequence[Any], task: Task, offset: int) -> tuple[Any, Any]:
            raise AssertionError("minibatches come from TaskRecords")  # never a sequence

        dataset = ElasticDataset(self.runner, source, read, feed,
                                 self.job_spec.minibatch_size, run_other_task=loop.run_task,
                                 wait_s=wait_s, on_data_error=fatal)
        self._dataset = dataset

        self.runner.start()
        try:
            if self.spec.train_loop is not None:
                ctx = ElasticLoopContext(self.runner, dataset, self.device,
                                       lr_scheduler=self.extras.scheduler, amp=self.amp)
                self.spec.train_loop(ctx)
                self._drain(ctx)
            else:
                for features, labels in dataset:
                    tag = dataset.take_current()
                    records = tag.records if tag is not None else batch_size_of(labels, features)
                    self.runner.submit(self._step, (features, labels), records, tag)
        finally:
            self.close()
        loop.stats.tasks += dataset.tasks_reported
        loop.stats.train_records += dataset.records_trained
        loop.stats.steps = self.state.model_version
        self._serve_rest(source, loop, wait_s)
        return loop.stats

    def _drain(self, ctx: ElasticLoopContext) -> None:
        leftover = 0
        step = ctx.step(self.runner.step_fn or self._step)
        for features, labels in ctx.dataset:
            leftover += 1
            step(features, labels)
        if leftover:
            logger.warning("train_loop returned before ctx.dataset was exhausted; its step "
                           "function trained the %d remaining minibatch(es)", leftover)

    def _serve_rest(self, source: TaskSource, loop: TaskLoop, wait_s: float) -> None:
        poller = TaskPoller(source, wait_s, loop.max_wait_s)
        while True:
            task = poller.next_task()
            if task.type == TaskType.NONE:
                return
            if task.type == TaskType.TRAINING:
                logger.error("training task %d after the group finished; handing it back",
                             task.task_id)
                source.report_task(task, "allreduce group already finished")
                time.sleep(wait_s)
            else:
                loop.run_task(task)
