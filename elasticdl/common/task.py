"""A task: a range of records of one shard, to train, evaluate or predict.

Shared by the master's job core, the wire conversions and the workers; no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class TaskType(enum.IntEnum):
    """Mirrors ``elasticdl.proto.TaskType``."""

    NONE = 0
    TRAINING = 1
    EVALUATION = 2
    PREDICTION = 3
    WAIT = 4
    # merge the stateful metric states of a model version's evaluation tasks and
    # report the exact global values (see elasticdl.master.evaluation)
    EVALUATION_FINALIZE = 6


@dataclass(frozen=True)
class Task:
    task_id: int
    type: TaskType
    shard_name: str
    start: int
    end: int
    epoch: int = 0
    model_version: int = -1
    # EVALUATION_FINALIZE only: the serialised metric states of each evaluation
    # task of ``model_version`` (attached when the task is handed out, never stored)
    metric_states: tuple[bytes, ...] = field(default=(), compare=False, repr=False)
    # TRAINING, on the wire only: reductions of a metric-driven LR schedule decided
    # when the task went out (elasticdl.master.lr_plateau)
    lr_reductions: int = field(default=0, compare=False, repr=False)
    # TRAINING, on the wire only: the learning-rate scale of --on_divergence=rollback
    # (elasticdl.master.training_health; 1.0 until a divergence rollback)
    lr_scale: float = field(default=1.0, compare=False, repr=False)
    # TRAINING, on the wire only: --divergence_sync's synchronous group of an async PS
    # job after a divergence rollback (0: the PS's own mode)
    sync_group: int = field(default=0, compare=False, repr=False)
    # allreduce TRAINING tasks: the master's closed training tasks as (generation,
    # flat [lo, hi) intervals), attached when handed out, never stored
    closed: Optional[tuple[int, tuple[int, ...]]] = field(default=None, compare=False,
                                                          repr=False)
    # line-indexed files, on the wire only: (first byte, end byte, fields per CSV record)
    # of the records, from the master's index (elasticdl.data.csv_reader.read_span)
    span: Optional[tuple[int, int, int]] = field(default=None, compare=False, repr=False)

    @property
    def num_records(self) -> int:
        return self.end - self.start


WAIT_TASK = Task(-1, TaskType.WAIT, "", 0, 0)
NO_MORE_TASKS = Task(-1, TaskType.NONE, "", 0, 0)


@dataclass(frozen=True)
class TaskFailure:
    """Why the job failed because of one task."""

    task: Task
    worker_id: int
    attempts: int
    error: str
    traceback: str = ""

    def describe(self) -> str:
        t = self.task
        return (f"{t.type.name.lower()} task {t.task_id} (records {t.start}-{t.end} of "
                f"{t.shard_name}) failed {self.attempts} time(s); last error on worker "
                f"{self.worker_id}: {self.error}")
