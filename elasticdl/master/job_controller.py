"""The job controller: the mechanics of a job on a cluster.

It is the only piece that changes the cluster: it launches and deletes
replicas, polls their events, applies the relaunch policy's decision and the
job core's bookkeeping (worker ids, lineages, failure counts, root cause,
re-queued tasks: :class:`JobCore`, each a journaled transition taken before
the launch or after the event it records), runs the recovery protocols (PS
rollback, final export: :mod:`elasticdl.master.executor`), and writes the
report the core keeps.

Its loop is explicit: :attr:`JobController.phase` (a
:class:`~elasticdl.master.job_phase.JobPhase`) moves only in :meth:`_step`,
one pass of the loop, by the pure rule
:func:`~elasticdl.master.job_phase.next_phase`; replicas are launched from
typed specs (:mod:`elasticdl.master.replica_launcher`).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Any, Optional

from elasticdl.checkpoint import restore
from elasticdl.cluster.api import (
    Cluster,
    ClusterError,
    Phase,
    ReplicaEvent,
    ReplicaInfo,
    ReplicaType,
)
from elasticdl.common import faults
from elasticdl.common.enums import JobType
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.strategy import entry_for
from elasticdl.master.elastic_control import ElasticControl
from elasticdl.master.executor import ProtocolExecutor
from elasticdl.master.job import JobCore
from elasticdl.master.job_phase import JobPhase, Observation, next_phase
from elasticdl.master.policy import Action, RelaunchPolicy
from elasticdl.master.rendezvous import RendezvousHandler
from elasticdl.master.replica_launcher import PSLaunch, ReplicaLauncher, WorkerLaunch
from elasticdl.master.training_health import HealthStatus, OnDivergence, final_status

logger = logging.getLogger(__name__)


class JobController:
    """Runs one job on a :class:`Cluster` until it succeeds or fails.

    Args:
        master_addr: the address replicas dial to reach the master.
        rendezvous: the allreduce rendezvous, or None.
        report_dir: where ``job_report.json`` is (re)written.
    """

    def __init__(self, spec: JobSpec, cluster: Cluster, core: JobCore,
                 master_addr: str, report_dir: str,
                 rendezvous: Optional[RendezvousHandler] = None,
                 policy: Optional[RelaunchPolicy] = None,
                 finish_timeout_s: float = 120.0, report_interval_s: float = 5.0):
        self.spec = spec
        self.cluster = cluster
        self.core = core
        self.tm = core.tm
        self.report = core.report
        self.book = core.replicas
        self.master_addr = master_addr
        self.report_dir = report_dir
        self.rendezvous = rendezvous
        self.policy = policy or RelaunchPolicy(spec.relaunch_on_worker_failure)
        self.finish_timeout_s = finish_timeout_s
        self.report_interval_s = report_interval_s
        self.phase = JobPhase.RUNNING
        self._finishing_since: Optional[float] = None   # when FINISHING began
        self._last_report = 0.0
        self.launcher = ReplicaLauncher(spec, cluster, master_addr)
        self.ps_addrs: list[str] = []
        self._ps_ports: list[int] = []
        self.executor = ProtocolExecutor(self)
        self.elastic = ElasticControl(self)   # elastic scheduling (master/scaling.py)

    # ------------------------------------------------------------ replicas
    def launch_ps(self, index: int, await_rollback: bool = False,
                  restore_from: Optional[str] = None) -> None:
        """Create PS ``index``, restoring ``restore_from`` (the master's restore rule:
        :mod:`elasticdl.checkpoint.restore`; None: the run's initial source);
        ``await_rollback``: into an open PS rollback."""
        self.launcher.launch(PSLaunch(
            ps_id=index, num_ps=self.spec.num_ps_pods, port=self._ps_ports[index],
            restore_from=restore_from or restore.initial_source(self.spec),
            version_floor=self.core.start_version(), await_rollback=await_rollback))
        self.core.notify("on_replica", kind="ps", index=index, alive=True)

    def _relaunch_ps(self, index: int) -> None:
        """A PS is gone: with a checkpoint to restore (the restore rule) a rollback
        of every PS to it opens (``--ps_recovery=alone``: of the lost PS only, when
        the checkpoint is this run's own), or the open one takes this PS too; the
        executor launches the PS and rolls back. Without any checkpoint it starts
        empty."""
        base = self.core.start_version()
        source = restore.rollback_source(self.spec, base)
        if source is not None and self.spec.ps_recovery == "alone" and \
                int(source["checkpoint"]) > base:
            source = {**source, "alone": True}
        if self.core.ps_lost(index, source, time.time()) is None:
            logger.warning("PS %d relaunched without a checkpoint: it takes a worker's "
                           "current model; updates it held are lost", index)
            self.launch_ps(index, restore_from=restore.NONE)

    def launch_worker(self, lineage: Optional[int] = None) -> int:
        worker_id = self.core.launch_worker(lineage)   # journaled before the launch
        faults.point("after_launch_intent")
        self.launcher.launch(WorkerLaunch(worker_id, tuple(self.ps_addrs)))
        self.elastic.launched(worker_id)
        return worker_id

    def _endpoints(self) -> int:
        num_ps = entry_for(self.spec.distribution_strategy).ps_to_launch(self.spec)
        for i in range(num_ps):
            port, addr = self.cluster.endpoint(ReplicaType.PS, i)
            self._ps_ports.append(port)
            self.ps_addrs.append(addr)
        return num_ps

    def start(self) -> None:
        """Launch the PS (ParameterServerStrategy) and the workers."""
        faults.point("before_start")
        num_ps = self._endpoints()
        for i in range(num_ps):
            self.launch_ps(i)
        for _ in range(self.spec.initial_workers):
            self.launch_worker()
        self.core.snapshot()

    def adopt(self, adopted: list[ReplicaInfo],
              finished: Optional[dict[tuple[ReplicaType, int],
                                      tuple[Phase, Optional[int]]]] = None) -> list[str]:
        """After a master restart: go on with the replicas still running (``adopted``,
        their PS endpoints kept); a worker that ``finished`` with exit 0 while no master
        watched (its last task done, the job near its end) is handled as that exit;
        every other PS and live worker of the restored core that is gone is handled as
        killed (its held tasks re-queued, relaunched). Returns the names of those lost."""
        finished = finished or {}
        have = {(r.type, r.index) for r in adopted}
        for r in adopted:
            self.core.notify("on_replica", kind=r.type.value, index=r.index, alive=True)
        self.elastic.adopted(adopted)
        num_ps = self._endpoints()
        lost = [ReplicaEvent(ReplicaType.PS, i, Phase.FAILED, None, "killed",
                             "gone while the master was down")
                for i in range(num_ps) if (ReplicaType.PS, i) not in have]
        done = []
        for w in sorted(self.book.live_workers):
            if (ReplicaType.WORKER, w) in have:
                continue
            if finished.get((ReplicaType.WORKER, w)) == (Phase.SUCCEEDED, 0):
                done.append(ReplicaEvent(ReplicaType.WORKER, w, Phase.SUCCEEDED, 0,
                                         "completed", "finished while the master was down"))
            else:
                lost.append(ReplicaEvent(ReplicaType.WORKER, w, Phase.FAILED, None, "killed",
                                         "gone while the master was down"))
        for event in done:
            logger.info("%s finished (exit 0) while the master was down", event.name)
            self._guarded(f"handling {event.name} finished", self.handle, event)
        for event in lost:
            logger.warning("%s is gone (it died while the master was down)", event.name)
            self._guarded(f"handling {event.name} lost", self.handle, event)
        if self.rendezvous is not None:
            # the rendezvous comes from the last snapshot: workers whose end was
            # journaled after it leave it now
            for w in self.rendezvous.state_dict()["workers"]:
                if not self.book.is_live(int(w)):
                    self.rendezvous.remove_worker(int(w))
        # a master that died while launching the job's workers: the rest of them
        # (relaunches take ids only after every initial worker has one)
        missing = self.spec.initial_workers - self.book.next_worker_id
        if missing > 0 and self.report.failure is None:
            logger.warning("the job's first launch was cut short: launching %d more "
                           "worker(s)", missing)
            for _ in range(missing):
                self.launch_worker()
        self.core.snapshot()
        return [e.name for e in lost]

    # --------------------------------------------------------------- hooks
    def on_worker_failure(self, worker_id: int, message: str, traceback: str) -> None:
        logger.error("worker %d reported: %s", worker_id, message)
        self.book.worker_reported(worker_id, message, traceback)

    # -------------------------------------------------------------- events
    def handle(self, event: ReplicaEvent) -> None:
        if event.phase in (Phase.PENDING, Phase.RUNNING):
            self.elastic.observe(event)
            return
        name = event.name
        self.core.notify("on_replica", kind=event.type.value, index=event.index, alive=False)
        key = f"{event.type.value}:" + str(self.book.lineage_of(event.index)
                                           if event.type == ReplicaType.WORKER else event.index)
        counts_as_failure = event.phase == Phase.FAILED and event.reason not in (
            "killed", "deleted", "preempted")
        failures = self.core.replica_gone(
            event.index if event.type == ReplicaType.WORKER else None,
            event.phase == Phase.SUCCEEDED, key, counts_as_failure)
        if event.type == ReplicaType.WORKER:
            self._worker_gone(event)
            if self.elastic.ended(event):
                return  # retired by a resize (or cancelled): not replaced
        # until the final model is written, a lost replica is replaced (a PS rollback
        # may even reopen training): the export needs a worker and every PS
        done = self.phase.winding_down and (self.spec.job_type != JobType.TRAIN or
                                    self.core.exported is not None)
        decision = self.policy.decide(event, failures, done)
        logger.info("%s %s (exit %s, %s): %s - %s", name, event.phase.value, event.exit_code,
                    event.reason, decision.action.value, decision.reason)
        if event.phase == Phase.FAILED and event.type == ReplicaType.WORKER:
            self._note_root_cause(event)
        if decision.action == Action.RELAUNCH:
            self._relaunch(event, decision.reason)
        elif decision.action == Action.FAIL_JOB:
            self.fail(name, decision.reason, "")
        elif decision.action == Action.DROP and event.type == ReplicaType.WORKER:
            self.elastic.dropped()

    def _worker_gone(self, event: ReplicaEvent) -> None:
        if event.phase != Phase.SUCCEEDED:
            self.core.recover_tasks(event.index)
        if self.rendezvous is not None:
            self.rendezvous.remove_worker(event.index)

    def _stop_hung_workers(self) -> None:
        """Allreduce: members the rendezvous left out of a plan for not checking in
        (hung: stopped, deadlocked, swapping) are stopped; their exit relaunches them
        through the usual path (reason ``deleted``), and their tasks are re-queued."""
        if self.rendezvous is None:
            return
        for worker_id in self.rendezvous.take_excluded():
            alive = self.book.is_live(worker_id)
            if not alive or self.phase.winding_down or self.tm.training_records_left() == 0:
                continue  # gone already, or training is over (members left the group)
            logger.warning("worker %d made no progress and was left out of the allreduce "
                           "group as hung; stopping it to relaunch it", worker_id)
            threading.Thread(target=self._delete_worker, args=(worker_id,),
                             name=f"stop-worker-{worker_id}", daemon=True).start()

    def _delete_worker(self, worker_id: int) -> None:
        try:
            self.cluster.delete_replica(ReplicaType.WORKER, worker_id)
        except ClusterError as e:
            logger.error("could not stop hung worker %d: %s", worker_id, e)

    def _note_root_cause(self, event: ReplicaEvent) -> None:
        self.core.note_exit(event.index, event.name, f"exited with {event.exit_code} "
                            f"({event.reason}) {event.message}".strip())

    def _relaunch(self, event: ReplicaEvent, reason: str) -> None:
        try:
            if event.type == ReplicaType.WORKER:
                new_id = self.launch_worker(lineage=self.book.lineage_of(event.index))
                new_name = f"worker-{new_id}"
            else:
                self._relaunch_ps(event.index)
                new_name = event.name
        except ClusterError as e:
            logger.error("relaunch of %s failed: %s", event.name, e)
            self.fail(event.name, f"relaunch failed: {e}", "")
            return
        self.report.add_relaunch(event.name, new_name, reason, event.exit_code)
        self.core.notify("on_relaunch", replica=event.name, new_replica=new_name, reason=reason,
                         version=self.core.version)
        logger.info("relaunched %s as %s (%s)", event.name, new_name, reason)
        faults.point("after_relaunch")

    def fail(self, replica: str, error: str, traceback: str) -> None:
        self.report.fail(replica, error, traceback)

    # ----------------------------------------------------------------- run
    def _guarded(self, what: str, fn: Any, *args: Any) -> None:
        """Run a step of the control loop; a master bug in it fails the job with
        its traceback in the report, never hangs it or leaves it ``running``."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - reported as the job's root cause
            logger.exception("internal error %s", what)
            self.fail("master", f"internal error {what}: {type(e).__name__}: {e}",
                      traceback.format_exc())

    def run(self, stop: threading.Event) -> str:
        """Drive the job until its phase is terminal; returns the final status
        (succeeded, failed, stopped)."""
        while not self.phase.is_terminal:
            self._step(stop)
        self._write_report()
        logger.info("job %s %s", self.spec.job_name, self.report.status)
        return self.report.status

    def _step(self, stop: threading.Event) -> None:
        """One pass: apply the cluster's events, advance the recovery protocols and
        the elastic scaling, write the report now and then, then move the phase."""
        events = self.cluster.poll_events(0.2)
        for event in events:
            self._guarded(f"handling {event.name} {event.phase.value}", self.handle, event)
        if any(e.phase not in (Phase.PENDING, Phase.RUNNING) for e in events) or \
                self.report.failure is not None:
            self.core.snapshot()  # replica bookkeeping is not in the journal's records
        self._guarded("stopping hung workers", self._stop_hung_workers)
        self._guarded("advancing the recovery protocols", self.executor.advance)
        self._guarded("elastic scaling", self.elastic.step)
        self._guarded("judging the training loss", self._check_health)
        self._guarded("relaunching workers for reopened training", self._reopened)
        now = time.monotonic()
        if now - self._last_report >= self.report_interval_s:
            self._last_report = now
            self.core.snapshot()  # keeps the journal (and a replay) short
            self._write_report()
            self._log_progress()
        step = next_phase(self.phase, self._finishing_since, self._observe(stop, now),
                          self.finish_timeout_s)
        if step.failure is not None:
            self.fail(*step.failure)
        elif step.phase in (JobPhase.SUCCEEDED, JobPhase.STOPPED):
            # --on_divergence=warn: an unhealthy job never ends a plain "succeeded", nor
            # one that needed a divergence rollback to end healthy (nor one whose model
            # collapsed in its last tasks: judged now, too late to act on but to mark)
            self.core.finish_health()
            verdict = self.core.health_verdict()
            if verdict is not None and step.phase == JobPhase.SUCCEEDED and \
                    self.spec.on_divergence == OnDivergence.FAIL.value:
                self._fail_on(verdict)
                return
            self.report.status = final_status(step.phase.value, verdict,
                                              self.core.divergence_rollbacks())
        self.phase, self._finishing_since = step.phase, step.since

    def _fail_on(self, verdict: tuple[HealthStatus, str]) -> None:
        """``--on_divergence=fail``: the job fails with the verdict as its root cause."""
        self.fail("master", f"training {verdict[0].value}: {verdict[1]} (--on_divergence=fail; "
                  "evidence: training_health in the report)", "")

    def _check_health(self) -> None:
        """``--on_divergence=fail``: an unhealthy verdict fails the job, naming it;
        ``rollback``: every PS rolls back to the newest checkpoint at or before the
        best window (a collapse: before it began), the learning rate cut (at most
        --max_divergence_rollbacks times; then, or without such a checkpoint, the job
        fails)."""
        mode = self.spec.on_divergence
        if mode not in (OnDivergence.FAIL.value, OnDivergence.ROLLBACK.value) or \
                self.report.failure is not None:
            return
        verdict = self.core.health_verdict()
        if verdict is None:
            return
        what = f"training {verdict[0].value}: {verdict[1]}"
        if mode == OnDivergence.FAIL.value:
            self._fail_on(verdict)
            return
        if self.core.rolling_back():
            return   # a PS rollback is open: judged again once it closes
        done = self.core.divergence_rollbacks()
        if done >= self.spec.max_divergence_rollbacks:
            self.fail("master", f"{what}, after {done} divergence rollback(s) "
                      "(--max_divergence_rollbacks; evidence: training_health in the report)",
                      "")
            return
        window = self.spec.health_window_tasks * self.spec.num_minibatches_per_task
        best = self.core.health_rollback_version(collapse_margin=window)
        earlier = [(r["checkpoint_version"], r["new_version"])   # divergence rollbacks'
                   for r in self.report.extra.get("ps_rollbacks", []) if "lr_scale" in r]
        source = restore.divergence_source(self.spec, self.core.start_version(), best,
                                           earlier[-1] if earlier else None, window)
        if source is None:
            self.fail("master", f"{what}; no checkpoint at or before model version {best} "
                      "(the best loss, or before a collapse) to roll back to "
                      "(--on_divergence=rollback: set --checkpoint_steps lower, "
                      "--keep_checkpoint_max higher)", "")
            return
        self.core.divergence_rollback(source, time.time())
        logger.warning("%s: rolling every PS back to checkpoint %d (at most version %d: the "
                       "best loss, or a detector window before a collapse), learning rates x%g%s "
                       "from now on "
                       "(divergence rollback %d of at most %d)", what, source["checkpoint"], best,
                       self.core.lr_scale(),
                       ", pushes applied synchronously (--divergence_sync)"
                       if self.spec.use_async and self.spec.divergence_sync else "",
                       done + 1, self.spec.max_divergence_rollbacks)

    def _reopened(self) -> None:
        """A PS rollback (a PS lost, the loss diverged) re-queued training after every
        worker had finished and exited, none failing: launch the job's minimum of
        workers for it (else the job would fail with every worker gone)."""
        b = self.book
        if self.spec.job_type != JobType.TRAIN or self.phase.is_terminal or \
                b.next_worker_id == 0 or b.num_live() or b.first_failure is not None or \
                self.core.finished():
            return
        for _ in range(max(1, self.spec.workers_min)):
            self.launch_worker()
        logger.warning("training reopened (a PS rollback) after every worker had finished: "
                       "launched %d worker(s)", max(1, self.spec.workers_min))

    def _observe(self, stop: threading.Event, now: float) -> Observation:
        """What :func:`next_phase` decides from (only what the step it takes needs)."""
        if stop.is_set() or self.report.failure is not None:
            return Observation(now, stop_requested=stop.is_set(),
                               failed=self.report.failure is not None)
        f = self.tm.failure
        if f is not None:
            return Observation(now, task_failure=(f"worker-{f.worker_id}", f.describe(),
                                                  f.traceback))
        return Observation(
            now, finished=self.core.finished(),
            exported=self.spec.job_type != JobType.TRAIN or self.core.exported is not None,
            live_workers=self.book.num_live(), first_failure=self.book.first_failure)

    def _write_report(self) -> None:
        self.report.extra["workers"] = self.elastic.report()
        self.core.refresh_report().write(self.report_dir)

    def _log_progress(self) -> None:
        done = sum(e["records_completed"] for e in self.report.epochs)
        done += self.tm.prediction_ledger.records_completed
        total = self.tm.training_records * self.spec.num_epochs + self.tm.prediction_records
        elapsed = time.time() - self.report.started
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else float("inf")
        counts = self.elastic.counts
        logger.info("progress: %d/%d records (%.1f%%), %.1f records/s, ETA %s, workers %d "
                    "(%d pending), model version %d", done, total, 100.0 * done / max(total, 1),
                    rate, "?" if eta == float("inf") else f"{eta:.0f}s", counts.num_running(),
                    counts.num_pending(), self.core.version)
