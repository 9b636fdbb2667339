"""The strategy registry: what each ``--distribution_strategy`` means.

One :class:`StrategyEntry` per :class:`~elasticdl.common.enums.Strategy` says
which replicas the master launches (parameter servers or not), whether the job
needs the master's rendezvous, whether training runs in the submitting process,
and which :class:`~elasticdl.worker.runtime.WorkerRuntime` a worker builds. The
runtime is named ``"module:Class"`` and imported only by :func:`runtime_class`,
so the master, which reads this registry, never imports torch.

Code that behaves differently per strategy asks this registry; it never
compares strategy names.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticdl.common.enums import JobType, Strategy

if TYPE_CHECKING:
    from elasticdl.common.job_spec import JobSpec
    from elasticdl.worker.runtime import WorkerRuntime

#: the runtime every strategy's workers use for evaluate and predict jobs: a
#: model loaded from ``--checkpoint_dir_for_init`` driven by the task loop
INFERENCE_RUNTIME = "elasticdl.worker.runtime:LocalRuntime"


@dataclass(frozen=True)
class StrategyEntry:
    """How one strategy runs a training job.

    Attributes:
        strategy: the registered strategy.
        launches_ps: the master launches ``--num_ps_pods`` parameter servers.
        needs_rendezvous: the master runs a rendezvous (elastic allreduce).
        in_process_training: training runs in the submitting process, one
            replica, no master (``Local``); its workers never train.
        supports_async: ``--use_async`` applies.
        runtime: the worker runtime for training, ``"module:Class"``; empty
            when workers of this strategy never train.
    """

    strategy: Strategy
    launches_ps: bool
    needs_rendezvous: bool
    in_process_training: bool
    supports_async: bool
    runtime: str

    def num_ps(self, spec: JobSpec) -> int:
        """Parameter servers the job is configured with (0 without a PS)."""
        return spec.num_ps_pods if self.launches_ps else 0

    def ps_to_launch(self, spec: JobSpec) -> int:
        """Parameter servers the master launches for this job."""
        return self.num_ps(spec) if spec.job_type == JobType.TRAIN else 0

    def rendezvous_needed(self, spec: JobSpec) -> bool:
        """Whether the master must create a rendezvous for this job."""
        return self.needs_rendezvous and spec.job_type == JobType.TRAIN

    def runtime_path(self, job_type: JobType) -> str:
        """``"module:Class"`` of the runtime a worker builds for ``job_type``.

        Raises:
            ValueError: training with a strategy whose workers never train.
        """
        if job_type != JobType.TRAIN:
            return INFERENCE_RUNTIME
        if not self.runtime:
            raise ValueError(f"strategy {self.strategy} does not run distributed workers")
        return self.runtime


_REGISTRY: dict[Strategy, StrategyEntry] = {}


def register(entry: StrategyEntry) -> None:
    """Add (or replace) the entry of ``entry.strategy``."""
    _REGISTRY[entry.strategy] = entry


def entry_for(strategy: Strategy | str) -> StrategyEntry:
    """The entry of a strategy, by enum or by its flag value.

    Raises:
        ValueError: the strategy is unknown or not registered.
    """
    key = Strategy(strategy)
    try:
        return _REGISTRY[key]
    except KeyError:
        raise ValueError(f"strategy {key} is not registered") from None


def runtime_class(spec: JobSpec) -> type[WorkerRuntime]:
    """Import and return the worker runtime class for this job.

    Raises:
        ValueError: the strategy's workers do not run this job type.
        ImportError / AttributeError: the registered runtime does not exist.
    """
    module, _, name = entry_for(spec.distribution_strategy).runtime_path(
        spec.job_type).partition(":")
    cls: type[WorkerRuntime] = getattr(importlib.import_module(module), name)
    return cls


register(StrategyEntry(Strategy.LOCAL, launches_ps=False, needs_rendezvous=False,
                       in_process_training=True, supports_async=False, runtime=""))
register(StrategyEntry(Strategy.PS, launches_ps=True, needs_rendezvous=False,
                       in_process_training=False, supports_async=True,
                       runtime="elasticdl.worker.runtime:PSRuntime"))
register(StrategyEntry(Strategy.ALLREDUCE, launches_ps=False, needs_rendezvous=True,
                       in_process_training=False, supports_async=False,
                       runtime="elasticdl.worker.runtime:AllreduceRuntime"))
