"""The job controller's side of elastic scheduling: it applies what the
:class:`~elasticdl.master.scaling.ScalingPolicy` decides.

The controller calls :meth:`ElasticControl.observe` for pending/running
events, :meth:`ElasticControl.ended` when a worker is gone, and
:meth:`ElasticControl.step` once per pass of its loop. Retiring a worker (a
``scale`` down) is two steps: the master stops handing it tasks (``get_task``
answers WAIT), and once it holds none it is deleted; its end is then not
replaced. A worker deleted while holding a task (a pending one, or the retire
grace ran out) has its tasks re-queued through the usual path, so no record is
lost or trained twice (the PS ledger and the allreduce trained-record set
skip what was applied).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional, Protocol

from elasticdl.cluster.api import (
    Cluster,
    ClusterError,
    Phase,
    ReplicaEvent,
    ReplicaInfo,
    ReplicaType,
)
from elasticdl.common.job_report import JobReport
from elasticdl.common.job_spec import JobSpec, JobSpecError, parse_worker_range
from elasticdl.master.autoscale import REASON, AutoScaler, is_autoscale
from elasticdl.master.job import JobCore
from elasticdl.master.protocols import Kind as ProtocolKind
from elasticdl.master.replicas import ReplicaBook
from elasticdl.master.scaling import Kind, ScalingPolicy, WorkerCounts
from elasticdl.master.task_manager import TaskManager

logger = logging.getLogger(__name__)

RETIRE_GRACE_S = 120.0   # a retired worker still holding a task after this is deleted


class Controller(Protocol):
    """What elastic scheduling needs of the job controller (``JobController`` has
    it): the job, its core and their parts, the cluster (resize requests, deleting
    a worker), and the launch and the failure it applies."""

    @property
    def spec(self) -> JobSpec: ...

    @property
    def core(self) -> JobCore: ...

    @property
    def tm(self) -> TaskManager: ...

    @property
    def book(self) -> ReplicaBook: ...

    @property
    def report(self) -> JobReport: ...

    @property
    def cluster(self) -> Cluster: ...

    def launch_worker(self, lineage: Optional[int] = None) -> int: ...

    def fail(self, replica: str, error: str, traceback: str) -> None: ...


class ElasticControl:
    def __init__(self, controller: Controller, policy: Optional[ScalingPolicy] = None):
        self.c = controller
        spec = controller.spec
        self.policy = policy or ScalingPolicy()
        core = controller.core
        existing = core.attachments.get("scaling")
        if existing is not None:  # attached before a restore (master/main.py): as restored
            self.counts: WorkerCounts = existing
        else:
            self.counts = WorkerCounts(spec.workers_min, spec.initial_workers)
            core.attachments["scaling"] = self.counts   # snapshotted with the core
            if core.restored_extra.get("scaling"):
                self.counts.load_state_dict(core.restored_extra["scaling"])
        self.auto: Optional[AutoScaler] = None
        if spec.autoscale:
            # restored: the size the journal holds; the bounds of the last resize a
            # user asked for (elasticdl scale), else the job's MIN:MAX
            floor, ceiling = spec.workers_min, spec.num_workers
            for r in self.counts.resizes:
                if not is_autoscale(r["reason"]):
                    floor, ceiling = parse_worker_range(r["to"])
            window = spec.autoscale_window_s
            self.auto = AutoScaler(spec.autoscale, floor, ceiling, settle_s=window / 2,
                                   window_s=window, start_timeout_s=max(9 * window, 60.0),
                                   hold_s=15 * window,
                                   target=min(max(self.counts.max_workers, floor), ceiling))
        self._resizes_seen = self.counts.resizes_total
        self._retired_at: dict[int, float] = {}
        self._stopping: set[int] = set()
        self._said_pending: dict[int, str] = {}

    # ------------------------------------------------------------ events
    def observe(self, event: ReplicaEvent) -> None:
        if event.type != ReplicaType.WORKER or not self.c.book.is_live(event.index):
            return
        running = event.phase == Phase.RUNNING
        self.counts.observe(event.index, running, event.message if not running else "")
        if not running and event.message and \
                self._said_pending.get(event.index) != event.message:
            self._said_pending[event.index] = event.message
            logger.warning("worker %d pending: %s", event.index, event.message)

    def adopted(self, replicas: list[ReplicaInfo]) -> None:
        for r in replicas:
            if r.type == ReplicaType.WORKER:
                self.counts.observe(r.index, r.phase == Phase.RUNNING)

    def launched(self, worker_id: int) -> None:
        self.counts.launched(worker_id)

    def ended(self, event: ReplicaEvent) -> bool:
        """A worker is gone; True when it was retired (not to be replaced)."""
        self._said_pending.pop(event.index, None)
        self._retired_at.pop(event.index, None)
        self._stopping.discard(event.index)
        retired = self.counts.gone(event.index, done=event.phase == Phase.SUCCEEDED,
                                   preempted=event.reason == "preempted")
        if retired:
            logger.info("worker %d retired (%s)", event.index, event.phase.value)
        return retired

    def dropped(self) -> None:
        """A worker left for good by the relaunch policy: its slot is not refilled."""
        with self.counts._lock:
            self.counts.slots_closed += 1

    # ------------------------------------------------------------ decisions
    def _idle(self, live: tuple[int, ...]) -> frozenset[int]:
        tm = self.c.tm
        with tm._lock:
            busy = {d.worker_id for d in tm._doing.values()}
        return frozenset(w for w in live if w not in busy)

    def _requested(self) -> None:
        """A resize asked through the cluster (Kubernetes: the master pod's annotation)."""
        wanted = self.c.cluster.requested_workers()
        if not wanted or wanted == self.counts.last_request:
            return
        self.counts.last_request = wanted
        try:
            low, high = parse_worker_range(wanted)
        except JobSpecError as e:
            logger.error("ignoring the resize request %r: %s", wanted, e)
            return
        self.c.core.resize_workers(low, high, f"elasticdl scale --num_workers={wanted}")
        self.c.core.durable()
        logger.info("resize to %d:%d requested", low, high)

    def _autoscale(self) -> None:
        """--autoscale: follow a user's resize, then let the autoscaler decide the size."""
        auto, c, counts = self.auto, self.c, self.counts
        if auto is None:
            return
        now = time.monotonic()
        if counts.resizes_total != self._resizes_seen:
            last = counts.resizes[-1] if counts.resizes else None
            if last is not None and not is_autoscale(last["reason"]):
                target = auto.rebound(counts.min_workers, counts.max_workers, now)
                if target != counts.max_workers:
                    c.core.resize_workers(counts.min_workers, target,
                                          f"{REASON}: from {target} within the new range "
                                          f"{counts.min_workers}:{auto.ceiling}")
                    c.core.durable()
            self._resizes_seen = counts.resizes_total
        if c.core.finished():
            return
        # training: running, not retiring, and given a task (built its model: a worker
        # still importing torch would count as a worker adding nothing)
        training = sum(1 for w in counts.training() if c.tm.has_worked(w))
        decision = auto.step(now, c.tm.training_records_done(), training)
        if decision is not None:
            target, reason = decision
            c.core.resize_workers(auto.floor, target, reason)
            c.core.durable()
            self._resizes_seen = counts.resizes_total
            logger.info("%s", reason)

    def step(self) -> None:
        """Decide from the current view and apply the decisions (one pass)."""
        c = self.c
        self._requested()
        self._autoscale()
        spec = c.spec
        live = tuple(sorted(c.book.live_workers))
        exporting = any(p.kind == ProtocolKind.EXPORT for p in c.core.open_protocols())
        view = self.counts.view(live, self._idle(live), c.core.finished(),
                                spec.min_workers_timeout_s,
                                spec.on_min_workers_timeout == "fail", exporting)
        for d in self.policy.decide(view):
            if d.kind == Kind.LAUNCH:
                for _ in range(d.count):
                    worker_id = c.launch_worker()
                    logger.info("launched worker %d (%s)", worker_id, d.reason)
            elif d.kind == Kind.RETIRE:
                self.counts.retire(d.workers)
                now = time.monotonic()
                for w in d.workers:
                    self._retired_at[w] = now
                logger.info("retiring worker(s) %s (%s)", list(d.workers), d.reason)
                c.core.snapshot()
            elif d.kind in (Kind.STOP, Kind.CANCEL):
                self._delete(d.workers, d.reason)
            elif d.kind == Kind.UNDER_MIN:
                self.counts.warned = True
                logger.warning("under MIN: %s; waiting (--on_min_workers_timeout=wait)",
                               d.reason)
                c.report.extra.setdefault("warnings", []).append(f"under MIN: {d.reason}")
                del c.report.extra["warnings"][:-20]
            elif d.kind == Kind.FAIL:
                c.fail("master", f"too few workers: {d.reason} "
                       "(--on_min_workers_timeout=fail)", "")
        self._force_stuck_retirees()

    def _force_stuck_retirees(self) -> None:
        now = time.monotonic()
        late = tuple(w for w, t in self._retired_at.items()
                     if now - t > RETIRE_GRACE_S and w not in self._stopping)
        if late:
            self._delete(late, f"retired and still busy after {RETIRE_GRACE_S:.0f} s; its "
                         "task is re-queued")

    def _delete(self, workers: tuple[int, ...], reason: str) -> None:
        for w in workers:
            if w in self._stopping:
                continue
            self._stopping.add(w)
            self.counts.retire((w,))   # its end is not replaced
            logger.info("stopping worker %d (%s)", w, reason)
            threading.Thread(target=self._delete_one, args=(w,), daemon=True,
                             name=f"retire-worker-{w}").start()

    def _delete_one(self, worker_id: int) -> None:
        try:
            self.c.cluster.delete_replica(ReplicaType.WORKER, worker_id)
        except ClusterError as e:
            logger.error("could not stop worker %d: %s", worker_id, e)
            self._stopping.discard(worker_id)

    # ------------------------------------------------------------ report
    def report(self) -> dict[str, Any]:
        out = self.counts.report()
        if self.auto is not None:
            out["autoscale"] = self.auto.state()
            out["max"] = self.auto.ceiling   # the job's MAX; "requested": the size now
            out["requested"] = self.counts.max_workers
        return out
