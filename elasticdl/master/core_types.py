"""Values the job core's calls take and give (:mod:`elasticdl.master.job`),
apart from the core so that its journal replay and its servicer name them
without importing the core."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Optional

Metric = tuple[str, float, int]
"""An evaluation metric: ``(name, value, records)``."""


class Refusal(NamedTuple):
    """A result of a batch refused (:meth:`JobCore.report_tasks`): its position in
    the batch, why, and whether the request was invalid (else the worker may not
    report it)."""

    position: int
    reason: str
    invalid: bool


class TaskResult(NamedTuple):
    """One task outcome of a batch (:meth:`JobCore.report_tasks`), in the order of
    :meth:`JobCore.report_task`'s arguments after the worker."""

    task_id: int
    success: bool
    error: str = ""
    traceback: str = ""
    fatal: bool = False
    counters: Optional[Mapping[str, int]] = None
    model_version: Optional[int] = None
    loss: Optional[float] = None
    learning_rate: Optional[float] = None
