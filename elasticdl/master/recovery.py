"""The job core's recovery transitions: protocol steps, replica identities, the
final export (mixed into :class:`~elasticdl.master.job.JobCore`).

Every method here is one journaled transition (an :class:`Op` with its replay
in :data:`elasticdl.master.job_journal.HANDLERS`), taken under the core's lock
and written before the controller does what it names: a restarted master
replays them and resumes each open protocol from its step (see
:mod:`elasticdl.master.protocols`).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Optional

from elasticdl.common.enums import JobType
from elasticdl.common.intervals import IntervalSet
from elasticdl.master.protocols import Kind, Protocol, ProtocolBook, Step
from elasticdl.master.task_state import EVAL_TYPES

if TYPE_CHECKING:
    from elasticdl.common.job_report import JobReport
    from elasticdl.master.replicas import ReplicaBook
    from elasticdl.master.task_manager import TaskManager

logger = logging.getLogger("elasticdl.master.job")


class Recovery:
    """Recovery transitions of the job core (it sets ``protocols``)."""

    tm: TaskManager
    replicas: ReplicaBook
    # only a worker that trained holds the model (allreduce members; a PS worker
    # pulls it from the PS, so any may export): set before a restore replays
    export_requires_training = False
    report: JobReport
    protocols: ProtocolBook
    job_type: JobType
    version: int
    _start: int
    _lock: threading.RLock

    if TYPE_CHECKING:
        def _log(self, op: str, **fields: Any) -> None:
            ...

        def _now(self) -> float:
            ...

        def _at(self, t: Optional[float] = None) -> Any:
            ...

        def finished(self) -> bool:
            ...

        def _rollback(self, applied: dict[int, int], new_version: int,
                      closed: Optional[IntervalSet] = None) -> list[int]:
            ...

        def _after_rollback(self, lost: list[int]) -> None:
            ...

    # ------------------------------------------------------------ incarnation
    def new_incarnation(self) -> int:
        """A master starts (or takes over): steps it takes carry this number."""
        with self._lock:
            self.protocols.incarnation += 1
            self._log("incarnation", n=self.protocols.incarnation)
            return self.protocols.incarnation

    def start_version(self) -> int:
        """The version the run started from (its base, see restore.run_base)."""
        with self._lock:
            return int(self._start)

    # ------------------------------------------------------------ PS rollback
    def rolling_back(self) -> bool:
        with self._lock:
            return self.protocols.find(Kind.ROLLBACK) is not None

    def ps_lost(self, index: int, source: Optional[dict[str, Any]], now: float
                ) -> Optional[Protocol]:
        """PS ``index`` is gone. With a restore ``source`` (``{"dir", "checkpoint"}``,
        the master's rule: :func:`elasticdl.checkpoint.restore.rollback_source`) a
        rollback protocol opens, or the open one takes this PS too (back to
        REQUESTED, its source kept). Returns the protocol, None without a source."""
        with self._lock:
            p = self.protocols.find(Kind.ROLLBACK)
            if p is not None:
                launch = sorted(set(p.data["launch"]) | {index})
                p = self.protocols.step(p.pid, Step.REQUESTED, launch=launch)
                logger.warning("PS %d lost during rollback %d: it joins it (PS %s to launch)",
                               index, p.pid, launch)
            elif source is not None:
                p = self.protocols.start(Kind.ROLLBACK, Step.REQUESTED,
                                         {"launch": [index], **source}, now)
            export = self.protocols.find(Kind.EXPORT)
            if p is not None and export is not None and export.step == Step.CLAIMED:
                # the model being exported is rolled back: the claim is void (a late
                # report of it is ignored); the export opens again once training is done
                self.protocols.step(export.pid, Step.OPEN, worker=None)
            self._log("ps_lost", index=index, source=source, now=now)
            return p

    def protocol_step(self, pid: int, step: Step, **data: Any) -> Protocol:
        with self._lock:
            p = self.protocols.step(pid, step, **data)
            self._log("protocol_step", pid=pid, step=step.value, data=data)
            return p

    def rollback_requeued(self, pid: int, applied: dict[int, int], new_version: int,
                          closed: Optional[IntervalSet] = None) -> list[int]:
        """Every PS rolled back (protocol ``pid``): re-queue what the checkpoint
        does not hold (``applied`` per task; ``closed``: tasks held whole, see
        :meth:`JobCore.rollback`), versions continue at ``new_version``."""
        with self._lock:
            lost = self._rollback(applied, new_version, closed)
            p = self.protocols.step(pid, Step.REQUEUED, new_version=new_version)
            self.protocols.rollbacks_done += 1
            self.report.extra.setdefault("ps_rollbacks", []).append(
                {"checkpoint_version": p.data.get("checkpoint"), "new_version": new_version})
            self._after_rollback(lost)
            self._log("rollback_requeued", pid=pid,
                      applied={str(k): v for k, v in applied.items()}, version=new_version,
                      closed=None if closed is None else closed.to_flat())
            return lost

    def protocol_close(self, pid: int) -> None:
        with self._lock:
            p = self.protocols.close(pid)
            if p.kind == Kind.EXPORT:
                self.protocols.exported = p.data.get("path", "")
            self._log("protocol_close", pid=pid)

    def open_protocols(self) -> list[Protocol]:
        with self._lock:
            return [Protocol.from_json(p.to_json()) for p in self.protocols.open.values()]

    # ----------------------------------------------------------------- export
    def claim_export(self, worker_id: int) -> bool:
        """Whether ``worker_id`` now claims the final export: the first to ask once
        the job is done (or once an exporter died); see :meth:`exporter`."""
        with self._lock, self._at() as t:
            if not (self.job_type == JobType.TRAIN and self.finished()) or \
                    self.protocols.exported is not None:
                return False
            p = self.protocols.find(Kind.EXPORT)
            if p is not None and p.step != Step.OPEN:
                return False
            load = None
            if self.export_requires_training and not self.tm.has_worked(worker_id):
                # e.g. an allreduce worker launched after training: it holds no model,
                # but may load the final checkpoint when there is one
                load = None if p is None else p.data.get("source")
                if load is None:
                    return False
            if p is None:
                p = self.protocols.start(Kind.EXPORT, Step.OPEN, {}, t)
            self.protocols.step(p.pid, Step.CLAIMED, worker=worker_id, load=load)
            self.protocols.export_attempts += 1
            self._log("export", t=t, w=worker_id)
            logger.info("worker %d exports the final model (attempt %d)", worker_id,
                        self.protocols.export_attempts)
            return True

    def exporter(self) -> Optional[int]:
        """The worker holding the export claim, if one does."""
        with self._lock:
            p = self.protocols.find(Kind.EXPORT)
            return p.data.get("worker") if p is not None and p.step == Step.CLAIMED else None

    def exporter_load(self) -> Optional[str]:
        """The checkpoint the claimant loads before it exports (it did not train)."""
        with self._lock:
            p = self.protocols.find(Kind.EXPORT)
            return p.data.get("load") if p is not None and p.step == Step.CLAIMED else None

    def export_source(self) -> Optional[str]:
        """The final model's checkpoint a worker that did not train may export from
        (see :meth:`open_export`)."""
        with self._lock:
            p = self.protocols.find(Kind.EXPORT)
            return None if p is None else p.data.get("source")

    def open_export(self, source: Optional[str]) -> None:
        """The export is open (no live worker holds a claim), and ``source``, when
        given, is a complete checkpoint of the final model (its data position holds
        every record of every epoch): any worker may claim the export and load it
        first, so an allreduce job whose trained members are all gone still
        exports. Without a source only a worker that trained may claim."""
        with self._lock, self._at() as t:
            p = self.protocols.find(Kind.EXPORT)
            if p is None:
                p = self.protocols.start(Kind.EXPORT, Step.OPEN, {}, t)
            if source is not None:
                p.data["source"] = source
            self._log("export_open", t=t, source=source)

    def export_pending(self) -> bool:
        """The job is done training but its final model is not written yet."""
        with self._lock:
            return self.job_type == JobType.TRAIN and self.protocols.exported is None

    def export_written(self, worker_id: int, path: str) -> bool:
        """The exporter wrote the final model at ``path``; False when ``worker_id``
        holds no claim (a late report of a replaced exporter: ignored)."""
        with self._lock:
            p = self.protocols.find(Kind.EXPORT)
            if p is None or p.step != Step.CLAIMED or p.data["worker"] != worker_id:
                return False
            self.protocols.step(p.pid, Step.WRITTEN, path=path)
            self._log("export_written", w=worker_id, path=path)
            return True

    def export_lost(self, pid: int) -> None:
        """The exporter died before writing: the export is open to the next worker."""
        with self._lock:
            self.protocols.step(pid, Step.OPEN, worker=None)
            self._log("export_lost", pid=pid)

    @property
    def exported(self) -> Optional[str]:
        return self.protocols.exported

    # --------------------------------------------------------------- replicas
    def launch_worker(self, lineage: Optional[int] = None) -> int:
        """The launch intent of a worker: its id (live from now), journaled before
        the controller creates it, so a restarted master never reuses it."""
        with self._lock:
            worker_id = self.replicas.new_worker(lineage)
            self._log("launch", lineage=lineage, id=worker_id)
            return worker_id

    def replica_gone(self, worker_id: Optional[int], succeeded: bool, key: str,
                     counts: bool) -> int:
        """A replica ended (``worker_id`` None: a PS); returns the failures of its
        lineage (``key``) so far, this one counted when ``counts``."""
        with self._lock:
            if worker_id is not None:
                self.replicas.worker_gone(worker_id, succeeded)
            failures = self.replicas.count_failure(key, counts)
            self._log("gone", w=worker_id, ok=succeeded, key=key, counts=counts)
            return failures

    def note_exit(self, worker_id: int, replica: str, fallback: str) -> None:
        with self._lock:
            self.replicas.note_exit(worker_id, replica, fallback)
            self._log("note_exit", w=worker_id, replica=replica, fallback=fallback)


def evaluations_after_rollback(core: Any) -> None:
    """After a PS rollback: the running evaluation measured a model the PS no
    longer hold, so its tasks are dropped and it runs again; an epoch the
    rollback reopened is evaluated again when it ends again (its epoch-end and
    final reasons wait for that); everything else is evaluated on the model as
    it now is, under the version the job now has."""
    tm = core.tm
    with tm._lock:
        reopened = {e for e in core._epochs_ended if tm._epoch_open_tasks.get(e, 0) > 0}
        core._epochs_ended -= reopened
        running = core._running
        if running is not None:
            version = running["version"]
            tm._blocks = [b for b in tm._blocks
                          if not (b.type in EVAL_TYPES and b.model_version == version)]
            tm._eval_requeued = type(tm._eval_requeued)(
                t for t in tm._eval_requeued if t.model_version != version)
            for task_id in [k for k, d in tm._doing.items()
                            if d.task.model_version == version and d.task.type in EVAL_TYPES]:
                del tm._doing[task_id]
            tm._eval_jobs.pop(version, None)
            core.aggregator.discard(version)
            core._running = None
            logger.warning("PS rollback: the evaluation of model version %d is dropped and "
                           "runs again (%s)", version, ", ".join(running["reasons"]))
            keep = [r for r in running["reasons"]
                    if not (running["epoch"] in reopened and r in ("epoch_end", "final"))]
            for reason in keep:
                core._request_evaluation(reason, None if running["epoch"] in reopened
                                         else running["epoch"])
        pending = core._pending
        if pending is not None and pending["epoch"] in reopened:
            pending["reasons"] = [r for r in pending["reasons"]
                                  if r not in ("epoch_end", "final")]
            if not pending["reasons"]:
                core._pending = None
        tm.hold_training = core._pending is not None
