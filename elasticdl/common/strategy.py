"""The strategy registry: what each ``--distribution_strategy`` means.

One :class:`StrategyEntry` per :class:`~elasticdl.common.enums.Strategy` says
which replicas the master launches (parameter servers or not), whether the job
needs the master's rendezvous and whether training runs in the submitting process.
The :class:`~elasticdl.worker.runtime.WorkerRuntime` a worker builds for a strategy is
registered by the worker package itself (:func:`elasticdl.worker.runtime.runtime_class`), so
this registry, which the master reads, names no worker code and never imports torch.

Code that behaves differently per strategy asks this registry; it never
compares strategy names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from elasticdl.common.enums import JobType, Strategy


class JobShape(Protocol):
    """What the registry reads of a job (a :class:`~elasticdl.common.job_spec.JobSpec`, which
    itself validates against this registry)."""

    @property
    def job_type(self) -> JobType: ...

    @property
    def num_ps_pods(self) -> int: ...


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
    """

    strategy: Strategy
    launches_ps: bool
    needs_rendezvous: bool
    in_process_training: bool
    supports_async: bool

    def num_ps(self, spec: JobShape) -> int:
        """Parameter servers the job is configured with (0 without a PS)."""
        return spec.num_ps_pods if self.launches_ps else 0

    def ps_to_launch(self, spec: JobShape) -> int:
        """Parameter servers the master launches for this job."""
        return self.num_ps(spec) if spec.job_type == JobType.TRAIN else 0

    def rendezvous_needed(self, spec: JobShape) -> bool:
        """Whether the master must create a rendezvous for this job."""
        return self.needs_rendezvous and spec.job_type == JobType.TRAIN


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


register(StrategyEntry(Strategy.LOCAL, launches_ps=False, needs_rendezvous=False,
                       in_process_training=True, supports_async=False))
register(StrategyEntry(Strategy.PS, launches_ps=True, needs_rendezvous=False,
                       in_process_training=False, supports_async=True))
register(StrategyEntry(Strategy.ALLREDUCE, launches_ps=False, needs_rendezvous=True,
                       in_process_training=False, supports_async=False))
