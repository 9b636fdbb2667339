"""What the job core's parts share, and the rule they follow.

The job core is one chain of classes, each adding one concern:
:class:`CoreBase` (its parts and its lock) <-
:class:`~elasticdl.master.job_journal.Journaled` (write-ahead journal,
snapshots, restore) <- :class:`~elasticdl.master.recovery.Recovery` (PS
rollback and settle, protocol steps, replica identities, the final export) <-
:class:`~elasticdl.master.job.JobCore` (dispatch, results, versions,
evaluations, the report, the state). The rule, for every one of them:

- **One lock.** ``_lock`` (re-entrant) guards the whole job state. Every
  method that reads or changes it takes ``_lock``; the parts it holds
  (:class:`~elasticdl.master.versions.ModelVersions`,
  :class:`~elasticdl.master.evaluation_barrier.EvaluationBarrier`, the replica
  book, the protocol book) have no lock of their own and are only called
  under it. The task manager's own lock guards its internals only.
- **Journal before return.** Every public state change appends its record
  (``_log``, an :class:`~elasticdl.master.journal_ops.Op`) under the lock
  before it returns, so the journal's order is the order of the changes and a
  replay (:mod:`elasticdl.master.job_replay`) decides alike.
"""

from __future__ import annotations

import abc
import threading
from typing import Any

from elasticdl.common.enums import JobType
from elasticdl.common.job_report import JobReport
from elasticdl.master.evaluation_barrier import EvaluationBarrier
from elasticdl.master.protocols import ProtocolBook
from elasticdl.master.replicas import ReplicaBook
from elasticdl.master.task_manager import TaskManager
from elasticdl.master.versions import ModelVersions


class CoreBase(abc.ABC):
    """The job core's parts, its one lock, and the hooks its mixins call."""

    tm: TaskManager
    report: JobReport
    replicas: ReplicaBook
    protocols: ProtocolBook
    versions: ModelVersions
    evaluations: EvaluationBarrier
    job_type: JobType

    def __init__(self) -> None:
        self._lock = threading.RLock()

    @abc.abstractmethod
    def state_dict(self, defer: bool = False) -> dict[str, Any]:
        """The whole job state, JSON-able (what a snapshot holds)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""

    @abc.abstractmethod
    def finished(self) -> bool:
        """Every task done, no evaluation due or running, no PS rollback open."""
