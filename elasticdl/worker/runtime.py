"""What a worker runs: the :class:`WorkerRuntime` ABC and its implementations.

A worker process (``elasticdl.worker.main``) asks :func:`runtime_class` which runtime
class the job needs (each strategy's training runtime is registered here, by class, with
:func:`register_runtime`; the master's strategy registry, :mod:`elasticdl.common.strategy`,
names no worker code), builds it
from a :class:`RuntimeContext` and calls the same four things on every
strategy: :meth:`~WorkerRuntime.run`, :meth:`~WorkerRuntime.export`,
:meth:`~WorkerRuntime.close` and, for checkpoints,
:meth:`~WorkerRuntime.state_dict` / :meth:`~WorkerRuntime.load_state_dict`.

* :class:`LocalRuntime`: a model in this process (:class:`LocalTrainer`) driven
  by the shared :class:`TaskLoop`; also every strategy's evaluate and predict
  jobs (the model comes from ``--checkpoint_dir_for_init``).
* :class:`PSRuntime`: :class:`PSTrainer` (parameters on the PS) driven by the
  same task loop.
* :class:`AllreduceRuntime`: one member of an elastic allreduce group; its
  :meth:`AllreduceTrainer.run` drives its own elastic loop.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from elasticdl.api.model_spec import ModelSpec, ModelSpecError
from elasticdl.checkpoint import api as ckpt
from elasticdl.common.enums import JobType, Strategy
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.strategy import entry_for
from elasticdl.common.task import TaskType
from elasticdl.data.api import DataReader
from elasticdl.elastic.group import CommClient
from elasticdl.worker.prediction import PredictionSink
from elasticdl.worker.task_loop import LoopStats, TaskLoop
from elasticdl.worker.task_source import TaskSource
from elasticdl.worker.trainer import LocalTrainer, Trainer, check_amp, select_device

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from elasticdl.worker.allreduce_trainer import AllreduceTrainer
    from elasticdl.worker.ps_trainer import PSTrainer

OnVersion = Callable[[int], None]
Readers = dict[TaskType, DataReader]
Closed = Optional[tuple[int, Sequence[int]]]   # the master's closed tasks: generation, flat


@dataclass(frozen=True)
class RuntimeContext:
    """Everything a runtime may need to build itself.

    Attributes:
        comm: the master's rendezvous as a client (allreduce only).
        ps_addrs: ``host:port`` of each parameter server (PS only).
        host: the address peers dial to reach this worker (allreduce only).
    """

    model_spec: ModelSpec
    job_spec: JobSpec
    worker_id: int = 0
    device: Optional[torch.device] = None  # None: from ``job_spec.device``
    comm: Optional[CommClient] = None
    ps_addrs: tuple[str, ...] = ()
    host: str = "127.0.0.1"

    def resolved_device(self) -> torch.device:
        return self.device if self.device is not None else \
            select_device(self.job_spec.device, self.worker_id)


TRAIN_LOOP_STRATEGIES = (Strategy.LOCAL.value, Strategy.ALLREDUCE.value)


def check_train_loop_supported(model_spec: ModelSpec, job_spec: JobSpec) -> None:
    """A module's ``train_loop(ctx)`` runs under Local and AllreduceStrategy only.

    Raises:
        ModelSpecError: the module defines ``train_loop`` and the job trains with
            another strategy (named with the module and the strategies that run it).
    """
    strategy = str(Strategy(job_spec.distribution_strategy).value)
    if (model_spec.train_loop is not None and job_spec.job_type == JobType.TRAIN
            and strategy not in TRAIN_LOOP_STRATEGIES):
        raise ModelSpecError(
            f"{model_spec.module_path} defines train_loop(ctx), which "
            f"--distribution_strategy={strategy} does not run (its steps happen on the "
            f"parameter servers); use {' or '.join(TRAIN_LOOP_STRATEGIES)}, or remove "
            "train_loop to train with the built-in loop")


class WorkerRuntime(ABC):
    """One worker's training, evaluation and prediction for one strategy."""

    @classmethod
    @abstractmethod
    def build(cls, ctx: RuntimeContext) -> WorkerRuntime:
        """The runtime for this job and worker.

        Raises:
            ModelSpecError: the model module's optimizer or model is unusable.
            CheckpointError: ``--checkpoint_dir_for_init`` holds nothing usable.
            RuntimeError: the device asked for is not available.
        """

    @property
    @abstractmethod
    def model_version(self) -> int:
        """The version of the model this worker holds (steps applied)."""

    @abstractmethod
    def run(self, source: TaskSource, readers: Readers, sink: Optional[PredictionSink] = None,
            on_version: Optional[OnVersion] = None) -> LoopStats:
        """Run the master's tasks until it has none left.

        Args:
            source: the master (or an in-process task manager).
            readers: the reader of each task type's dataset.
            sink: where prediction outputs go (predict jobs).
            on_version: called with the model version after every training step.

        Raises:
            DataError: bad data (the task was reported fatal first).
            ConnectionError: the master (or a PS) cannot be reached.
            TimeoutError: the master said WAIT for longer than the maximum wait.
            Exception: any other failure of a step, after the task was reported
                failed with its traceback.
        """

    @abstractmethod
    def export(self, directory: str) -> list[str]:
        """Write the final model (``model.pt``, a plain state dict) into
        ``directory``; returns the paths written.

        Raises:
            OSError: the directory cannot be written.
            ConnectionError: the parameters live elsewhere (PS) and cannot be read.
        """

    def save_final_checkpoint(self, closed: Closed = None) -> Optional[str]:
        """With ``--checkpoint_dir``: a checkpoint of the final model (training is
        over), whatever ``--checkpoint_steps`` left; the version directory, or None
        where the strategy has none to write (the exporting worker calls it).
        ``closed``: the master's closed tasks sent with the export order,
        ``(generation, flat intervals)``, for a data position that holds them."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release connections and process groups; idempotent; never raises."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """``{"model", "model_version", ...}`` of this worker's current model.

        Raises:
            ConnectionError: the parameters live elsewhere (PS) and cannot be read.
        """

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (e.g. from a checkpoint) before :meth:`run`.

        Raises:
            KeyError / RuntimeError: ``state`` does not match this model.
            RuntimeError: this runtime's state is not held by the worker (PS).
        """


class TaskLoopRuntime(WorkerRuntime):
    """A :class:`Trainer` driven by the shared :class:`TaskLoop`."""

    def __init__(self, trainer: Trainer, job_spec: JobSpec, worker_id: int = 0):
        self.trainer = trainer
        self.job_spec = job_spec
        self.worker_id = worker_id

    @property
    def model_version(self) -> int:
        return self.trainer.model_version

    def run(self, source: TaskSource, readers: Readers, sink: Optional[PredictionSink] = None,
            on_version: Optional[OnVersion] = None) -> LoopStats:
        after = []
        if on_version is not None:
            report = on_version
            after.append(lambda task, done, loss: report(self.trainer.model_version))
        loop = TaskLoop(source, self.trainer, self.trainer.spec, readers,
                        self.job_spec.minibatch_size, worker_id=self.worker_id,
                        prediction_sink=sink,
                        skip_nonfinite_steps=self.job_spec.skip_nonfinite_steps,
                        after_train_step=after,
                        eval_minibatch_size=self.job_spec.eval_minibatch_size,
                        lease_s=self.job_spec.task_lease_s,
                        read_ahead=self.job_spec.task_read_ahead)
        return loop.run()


class LocalRuntime(TaskLoopRuntime):
    """Model and optimizer in this process; for evaluate and predict jobs the
    model is loaded from ``--checkpoint_dir_for_init``."""

    trainer: LocalTrainer

    @classmethod
    def build(cls, ctx: RuntimeContext) -> LocalRuntime:
        spec = ctx.job_spec
        if spec.job_type != JobType.TRAIN:
            from elasticdl.worker.inference import inference_trainer

            return cls(inference_trainer(ctx.model_spec, spec, ctx.resolved_device()), spec,
                       ctx.worker_id)
        trainer = LocalTrainer(ctx.model_spec, ctx.resolved_device(), spec.seed,
                               amp=spec.amp, clip_grad_norm=spec.clip_grad_norm)
        return cls(trainer, spec, ctx.worker_id)

    def export(self, directory: str) -> list[str]:
        return ckpt.export_model(self.trainer.model, directory,
                                 self.job_spec.export_torchscript)

    def close(self) -> None:
        """Nothing to release."""

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)


class PSRuntime(TaskLoopRuntime):
    """Parameters on the parameter servers; the worker pulls and pushes."""

    trainer: PSTrainer

    @classmethod
    def build(cls, ctx: RuntimeContext) -> PSRuntime:
        from elasticdl.worker.ps_trainer import PSTrainer

        check_train_loop_supported(ctx.model_spec, ctx.job_spec)
        check_amp(ctx.job_spec.amp, ctx.resolved_device())
        trainer = PSTrainer(ctx.model_spec, list(ctx.ps_addrs), ctx.job_spec, ctx.worker_id,
                            ctx.resolved_device())
        if ctx.job_spec.job_type == JobType.TRAIN:
            from elasticdl.api.metric_schedule import check_replica

            check_replica(ctx.model_spec, ctx.job_spec, trainer.model)
        return cls(trainer, ctx.job_spec, ctx.worker_id)

    def export(self, directory: str) -> list[str]:
        # the PS hold the newest parameters: pull them first
        return self.trainer.export_model(directory)

    def save_final_checkpoint(self, closed: Closed = None) -> Optional[str]:
        # every PS writes its shard (and its trained records) of the final version
        from elasticdl.worker.ps_client import PSVersionsDifferError

        try:
            return self.trainer.save_checkpoint()
        except PSVersionsDifferError as e:
            # the PS versions of a sync job can part after a worker died between its
            # pushes to two PS (each PS applies an identity once, the version counts
            # differ): no single final version to name; the export goes on, and the
            # newest complete periodic checkpoint stays the one to resume from
            logger.warning("no final checkpoint: %s", e)
            return None

    def close(self) -> None:
        self.trainer.close()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.trainer.state_dict_from_ps(),
                "model_version": self.trainer.model_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise RuntimeError("a PS worker holds no state of its own: the parameter servers "
                           "restore theirs from --checkpoint_dir_for_init")


class AllreduceRuntime(WorkerRuntime):
    """One member of an elastic allreduce group."""

    def __init__(self, member: AllreduceTrainer):
        self.member = member

    @classmethod
    def build(cls, ctx: RuntimeContext) -> AllreduceRuntime:
        from elasticdl.worker.allreduce_trainer import AllreduceTrainer

        if ctx.comm is None:
            raise ValueError("the allreduce runtime needs the master's rendezvous (comm)")
        spec = ctx.job_spec
        if getattr(ctx.model_spec.module, "init_state", None) is not None:
            raise ModelSpecError(f"{ctx.model_spec.module_path} defines init_state (a model "
                                 "state carried across minibatches): AllreduceStrategy does "
                                 "not carry it; use Local or ParameterServerStrategy")
        device = ctx.resolved_device()
        member = AllreduceTrainer(ctx.model_spec, spec, ctx.worker_id, device, ctx.comm,
                                  ctx.host)
        if spec.job_type == JobType.TRAIN:
            from elasticdl.api.metric_schedule import check_replica

            check_replica(ctx.model_spec, spec, member.model)
        runtime = cls(member)
        if spec.checkpoint_dir_for_init:  # model, optimizer, version; not the data position
            runtime.load_state_dict(ckpt.load(spec.checkpoint_dir_for_init, str(device)))
        return runtime

    @property
    def model_version(self) -> int:
        return self.member.model_version

    def run(self, source: TaskSource, readers: Readers, sink: Optional[PredictionSink] = None,
            on_version: Optional[OnVersion] = None) -> LoopStats:
        on_step = []
        if on_version is not None:
            report = on_version
            on_step.append(lambda version, loss: report(version))
        return self.member.run(source, readers, prediction_sink=sink, on_step=on_step)

    def export(self, directory: str) -> list[str]:
        return ckpt.export_model(self.member.model, directory,
                                 self.member.job_spec.export_torchscript)

    def save_final_checkpoint(self, closed: Closed = None) -> Optional[str]:
        return self.member.save_final_checkpoint(closed)

    def close(self) -> None:
        self.member.close()

    def state_dict(self) -> dict[str, Any]:
        return self.member.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.member.load_state_dict(state)


#: each strategy's runtime for training jobs (filled by :func:`register_runtime`)
_TRAINING_RUNTIMES: dict[Strategy, type[WorkerRuntime]] = {}


def register_runtime(strategy: Strategy, runtime: type[WorkerRuntime]) -> None:
    """Make ``runtime`` the class a worker of ``strategy`` builds for training jobs (add or
    replace)."""
    _TRAINING_RUNTIMES[Strategy(strategy)] = runtime


def runtime_class(spec: JobSpec) -> type[WorkerRuntime]:
    """The worker runtime class for this job: the strategy's registered runtime for training,
    :class:`LocalRuntime` (a model from ``--checkpoint_dir_for_init`` driven by the task loop)
    for every strategy's evaluate and predict jobs.

    Raises:
        ValueError: the strategy is unknown, or its workers never train (``Local``).
    """
    strategy = entry_for(spec.distribution_strategy).strategy
    if spec.job_type != JobType.TRAIN:
        return LocalRuntime
    try:
        return _TRAINING_RUNTIMES[strategy]
    except KeyError:
        raise ValueError(f"strategy {strategy} does not run distributed workers") from None


register_runtime(Strategy.PS, PSRuntime)
register_runtime(Strategy.ALLREDUCE, AllreduceRuntime)
