"""The job core's recovery transitions: protocol steps, replica identities, the
final export (mixed into :class:`~elasticdl.master.job.JobCore`; the rule it
shares with the core's other parts: :mod:`elasticdl.master.core_base`).

Every method here is one journaled transition (an
:class:`~elasticdl.master.journal_ops.Op` with its replay in
:data:`elasticdl.master.job_replay.HANDLERS`), taken under the core's lock
and written before the controller does what it names: a restarted master
replays them and resumes each open protocol from its step (see
:mod:`elasticdl.master.protocols`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from elasticdl.common.enums import JobType
from elasticdl.common.intervals import IntervalSet
from elasticdl.master.job_journal import Journaled
from elasticdl.master.protocols import Kind, Protocol, Step

logger = logging.getLogger("elasticdl.master.job")


class Recovery(Journaled):
    """Recovery transitions of the job core (it sets ``protocols``); journaled
    through :class:`Journaled`."""

    # only a worker that trained holds the model (allreduce members; a PS worker
    # pulls it from the PS, so any may export): set before a restore replays
    export_requires_training = False
    # --divergence_lr_factor: each divergence rollback cuts the PS learning rates by it
    divergence_lr_factor = 0.5
    # --divergence_sync of an async PS job: after a divergence rollback the PS apply
    # pushes in synchronous groups of the live workers (sync_group)
    divergence_sync = False
    divergence_sync_workers = 1   # the group where the live workers are not known

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
            return int(self.versions.start)

    # ------------------------------------------------------------ PS rollback
    def rolling_back(self) -> bool:
        with self._lock:
            return self.protocols.find(Kind.ROLLBACK) is not None

    def begin_rollback(self) -> None:
        """A PS rollback starts: until :meth:`rollback` says at which version versions
        continue, the bound is unknown (the PS may already apply pushes above it), so
        versions above it are ignored, not refused; they come again with later reports."""
        with self._lock:
            self.versions.rollbacks_pending += 1
            self._log("begin_rollback")

    def end_rollback(self) -> None:
        """The PS rollback failed (the job fails); the bound holds again."""
        with self._lock:
            self.versions.rollbacks_pending = max(self.versions.rollbacks_pending - 1, 0)
            self._log("end_rollback")

    def rollback(self, applied: dict[int, int], new_version: int,
                 closed: Optional[IntervalSet] = None) -> list[int]:
        """The PS rolled back to a checkpoint; versions continue at ``new_version``.
        ``applied``: per task, the records every restored PS holds; ``closed``:
        tasks every restored PS holds whole (its compacted ledgers)."""
        with self._lock:
            lost = self._rollback(applied, new_version, closed)
            self._log("rollback", applied={str(k): v for k, v in applied.items()},
                      version=new_version, closed=None if closed is None else closed.to_flat())
            return lost

    def _rollback(self, applied: dict[int, int], new_version: int,
                  closed: Optional[IntervalSet] = None) -> list[int]:
        lost = self.tm.rollback(applied, new_version, closed)
        v = self.versions
        v.version = max(v.version, new_version)
        v.rollbacks_pending = max(v.rollbacks_pending - 1, 0)
        return lost

    def _records_redone(self) -> int:
        """Training records re-queued to be trained again so far (lock held)."""
        return sum(led.records_redone for led in self.tm.ledger.values())

    def closed_tasks(self) -> tuple[int, IntervalSet]:
        """``(generation, closed)``: the generation is the rollback version (a PS
        that rolled back to a higher one ignores this set); ``closed`` a copy of
        the ids of every task counted done (training tasks the PS folds; the ids
        of evaluation and prediction tasks hold no PS work)."""
        with self._lock:
            return self.tm.rollback_version, self.tm.completed.copy()

    def settle(self, checkpoint_version: int, held: IntervalSet) -> int:
        """Checkpoint ``checkpoint_version`` is complete on every PS and holds the
        tasks ``held`` whole on each: closed tasks among them can no longer be
        re-opened by a rollback, so their per-task detail goes. Returns how many
        settled."""
        with self._lock:
            n = self.tm.settle(checkpoint_version, held)
            self._log("settle", version=checkpoint_version, held=held.to_flat())
            return n

    def ps_lost(self, index: int, source: Optional[dict[str, Any]], now: float
                ) -> Optional[Protocol]:
        """PS ``index`` is gone. With a restore ``source`` (``{"dir", "checkpoint"}``,
        the master's rule: :func:`elasticdl.checkpoint.restore.rollback_source`;
        ``"alone": True`` with it: ``--ps_recovery=alone``, only the lost PS restore
        it) a rollback protocol opens, or the open one takes this PS too (back to
        REQUESTED, its source and mode kept). Returns the protocol, None without a
        source."""
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
            if p is not None:
                self._void_export_claim()
            self._log("ps_lost", index=index, source=source, now=now)
            return p

    def divergence_rollback(self, source: dict[str, Any], now: float) -> Optional[Protocol]:
        """The training loss diverged (``--on_divergence=rollback``): every PS goes back
        to ``source`` (no PS to launch; the checkpoint versions above it are set aside),
        the learning rates the PS apply are cut once more (:meth:`lr_scale`), and the
        loss is judged afresh when the rollback closes (:meth:`protocol_close`). None
        (nothing done) while a rollback is open."""
        with self._lock:
            if self.protocols.find(Kind.ROLLBACK) is not None:
                return None
            p = self.protocols.start(Kind.ROLLBACK, Step.REQUESTED,
                                     {"launch": [], "set_aside": True, **source}, now)
            self.protocols.divergence_rollbacks += 1
            self._void_export_claim()
            self._log("diverged", source=source, now=now)
            return p

    def _void_export_claim(self) -> None:
        """A rollback opened: the model being exported is rolled back, so a claimed
        export is void (a late report of it is ignored) and opens again once training
        is done (lock held)."""
        export = self.protocols.find(Kind.EXPORT)
        if export is not None and export.step == Step.CLAIMED:
            self.protocols.step(export.pid, Step.OPEN, worker=None)

    def divergence_rollbacks(self) -> int:
        with self._lock:
            return self.protocols.divergence_rollbacks

    def health_rollback_version(self, collapse_margin: int = 0) -> int:
        """The newest model version a divergence rollback may restore (the loss
        detector's ``rollback_version``: the best window's, or before a collapse
        began; 0: none). A collapse: ``collapse_margin`` versions earlier still — ReLUs
        die over many steps, and the model just before the first collapsed step is
        often dying already (async digits jobs: 4 of 5 restored from a checkpoint
        within 20 versions of the collapse collapsed again 6-30 versions later)."""
        with self._lock:
            health = getattr(self, "health", None)
            if health is None:
                return 0
            version = int(health.rollback_version)
            if health.cause == "collapsed":
                version = max(0, version - collapse_margin)
            return version

    def lr_scale(self) -> float:
        """What every training task tells the PS to scale their learning rates by:
        ``--divergence_lr_factor`` to the number of divergence rollbacks (1.0: none) —
        but the first of an async job that goes on synchronously (``--divergence_sync``):
        its remedy is the switch, which removes the stale gradients that diverged it; a
        cut as well would leave it training slower than the sync job it becomes (an
        async digits job rolled back with both ended at 0.883 against sync's 0.969)."""
        with self._lock:
            cuts = self.protocols.divergence_rollbacks
            if self.divergence_sync and cuts:
                cuts -= 1
            return float(self.divergence_lr_factor ** cuts)

    def sync_group(self) -> int:
        """What every training task tells an async PS job's PS after a divergence
        rollback (``--divergence_sync``): apply its pushes in groups of this many, one
        version a round of the live workers (stale gradients are what collapsed or
        diverged it); 0: the PS's own mode."""
        with self._lock:
            if not self.divergence_sync or not self.protocols.divergence_rollbacks:
                return 0
            replicas = getattr(self, "replicas", None)
            live = replicas.num_live() if replicas is not None else 0
            return max(1, live or self.divergence_sync_workers)

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
            redone_before = self._records_redone()
            lost = self._rollback(applied, new_version, closed)
            p = self.protocols.step(pid, Step.REQUEUED, new_version=new_version)
            self.protocols.rollbacks_done += 1
            if p.data.get("alone"):   # --ps_recovery=alone: the others kept their state
                self.report.extra.setdefault("ps_recoveries", []).append(
                    {"ps": list(p.data.get("restore", [])),
                     "checkpoint_version": p.data.get("checkpoint"),
                     "new_version": new_version, "tasks_requeued": len(lost),
                     "records_requeued": self._records_redone() - redone_before})
            else:
                entry = {"checkpoint_version": p.data.get("checkpoint"),
                         "new_version": new_version}
                if p.data.get("set_aside"):   # a divergence rollback: its remedy
                    entry["lr_scale"] = self.lr_scale()
                    entry["synchronous"] = self.divergence_sync
                self.report.extra.setdefault("ps_rollbacks", []).append(entry)
            self.evaluations.after_rollback(self.versions.version)
            self._log("rollback_requeued", pid=pid,
                      applied={str(k): v for k, v in applied.items()}, version=new_version,
                      closed=None if closed is None else closed.to_flat())
            return lost

    def protocol_close(self, pid: int) -> None:
        with self._lock:
            p = self.protocols.close(pid)
            if p.kind == Kind.EXPORT:
                self.protocols.exported = p.data.get("path", "")
            health = getattr(self, "health", None)
            if p.data.get("set_aside") and health is not None:
                # the loss is judged afresh once every PS holds the restored model (the
                # diverged one trained on until then: its losses are no evidence)
                health.restart()
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

    def worker_reported(self, worker_id: int, message: str, traceback: str) -> None:
        """A worker's own report of its failure (the job's root cause candidate)."""
        with self._lock:
            self.replicas.worker_reported(worker_id, message, traceback)
            self._log("worker_reported", w=worker_id, error=message, tb=traceback)

    def resize_workers(self, low: int, high: int, reason: str) -> dict[str, Any]:
        """New worker bounds MIN:MAX (``elasticdl scale``), journaled; the job
        controller reconciles the workers (elasticdl/master/scaling.py). Raises
        ValueError for bad bounds, LookupError without worker bookkeeping."""
        with self._lock, self._at() as t:
            counts = self.attachments.get("scaling")
            if counts is None:
                raise LookupError("this job keeps no worker bookkeeping")
            entry = counts.resize(low, high, reason)
            self._log("resize", t=t, min=low, max=high, reason=reason)
            return dict(entry)
