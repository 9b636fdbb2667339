"""Elastic scheduling: how many workers a job runs, and the record of it.

Decisions apart from mechanics (docs/elastic.md):

* :class:`WorkerCounts` is the master's view of its workers: which live worker
  is *running* and which *pending* (with the scheduler's reason), who is being
  *retired*, the bounds ``MIN:MAX`` (changed by ``elasticdl scale``), a bounded
  worker-count timeline, resizes with their reasons, time spent under MIN. Its
  state is JSON (snapshotted with the job core as the ``scaling`` attachment, so
  a restored master goes on with the same bounds and retirements).
* :class:`ScalingPolicy` is pure: from a :class:`ScalingView` it returns
  :class:`ScalingDecision` s — launch N workers, retire these, stop those
  (retired and idle), cancel pending ones (training over), say that the job is
  under MIN (warn or fail). The job controller applies them.

Nothing here grows with the job's history: the timeline keeps at most
``MAX_POINTS`` points (older ones thinned), resizes the last ``MAX_RESIZES``.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)

MAX_POINTS = 240
MAX_RESIZES = 100


class Kind(str, enum.Enum):
    LAUNCH = "launch"        # start ``count`` new workers
    RETIRE = "retire"        # stop handing ``workers`` tasks; stop them once idle
    STOP = "stop"            # delete ``workers`` (retired and holding no task)
    CANCEL = "cancel"        # delete ``workers`` (pending, training is over)
    UNDER_MIN = "under_min"  # fewer than MIN ran for longer than the bound: warn
    FAIL = "fail"            # ... and --on_min_workers_timeout=fail


@dataclass(frozen=True)
class ScalingDecision:
    kind: Kind
    reason: str
    count: int = 0
    workers: tuple[int, ...] = ()


@dataclass(frozen=True)
class ScalingView:
    """What the policy decides from (a snapshot; the controller builds it)."""

    min_workers: int
    max_workers: int
    live: tuple[int, ...]              # workers launched and not gone
    running: frozenset[int]
    pending: dict[int, str]            # worker -> the scheduler's reason ("" if none)
    retiring: frozenset[int]
    idle: frozenset[int]               # live workers holding no task
    slots_closed: int                  # workers done or dropped for good: not refilled
    finishing: bool                    # every task done
    under_min_s: float                 # seconds running < MIN so far (0: not under)
    min_timeout_s: float
    fail_on_timeout: bool
    warned: bool                       # UNDER_MIN already said for this stretch
    exporting: bool = False            # the final export is open: it may need the pending


@dataclass(frozen=True)
class ScalingPolicy:
    """Reconciles the live workers with ``MAX`` (idempotent: a restored master
    that decides again from the same view decides the same)."""

    def decide(self, v: ScalingView) -> list[ScalingDecision]:
        out: list[ScalingDecision] = []
        if v.finishing:
            if v.exporting:  # a pending worker may be the one launched to export
                return out
            cancel = tuple(sorted(w for w in v.live if w in v.pending and w not in v.running))
            if cancel:
                out.append(ScalingDecision(Kind.CANCEL, "training is over", workers=cancel))
            return out
        active = [w for w in v.live if w not in v.retiring]
        want = max(0, v.max_workers - v.slots_closed)
        if len(active) < want:
            out.append(ScalingDecision(Kind.LAUNCH, f"{len(active)} of {want} workers",
                                       count=want - len(active)))
        elif len(active) > v.max_workers:
            # pending ones first (they hold nothing), newest first
            order = sorted(active, key=lambda w: (w in v.running, -w))
            extra = tuple(sorted(order[:len(active) - v.max_workers]))
            out.append(ScalingDecision(Kind.RETIRE, f"{len(active)} workers, MAX is "
                                       f"{v.max_workers}", workers=extra))
        stop = tuple(sorted(w for w in v.retiring if w in v.live and
                            (w in v.idle or w not in v.running)))
        if stop:
            out.append(ScalingDecision(Kind.STOP, "retired", workers=stop))
        if v.under_min_s > v.min_timeout_s:
            why = "; ".join(sorted({r for r in v.pending.values() if r})) or \
                "no pending worker has a scheduler reason"
            msg = (f"{len(v.running)} of MIN {v.min_workers} workers running for "
                   f"{v.under_min_s:.0f} s (bound {v.min_timeout_s:.0f} s): {why}")
            if v.fail_on_timeout:
                out.append(ScalingDecision(Kind.FAIL, msg))
            elif not v.warned:
                out.append(ScalingDecision(Kind.UNDER_MIN, msg))
        return out


@dataclass
class _Pending:
    since: float
    reason: str = ""


@dataclass
class WorkerCounts:
    """The master's worker bookkeeping for elastic scheduling. Thread-safe."""

    min_workers: int
    max_workers: int
    clock: Callable[[], float] = time.time
    running: set[int] = field(default_factory=set)
    pending: dict[int, _Pending] = field(default_factory=dict)
    retiring: set[int] = field(default_factory=set)
    slots_closed: int = 0
    preempted: int = 0
    timeline: list[list[float]] = field(default_factory=list)  # [t, running, pending, preempted]
    resizes: list[dict[str, Any]] = field(default_factory=list)
    resizes_total: int = 0
    under_min_since: Optional[float] = None
    under_min_total_s: float = 0.0
    warned: bool = False
    started: Optional[float] = None
    last_request: str = ""   # the cluster's last "MIN:MAX" request applied

    def __post_init__(self) -> None:
        self._lock = threading.RLock()

    # ------------------------------------------------------------ events
    def observe(self, worker: int, running: bool, reason: str = "") -> None:
        """A live worker is running, or pending (``reason``: the scheduler's)."""
        with self._lock:
            if running:
                self.running.add(worker)
                self.pending.pop(worker, None)
            else:
                self.running.discard(worker)
                p = self.pending.setdefault(worker, _Pending(self.clock()))
                p.reason = reason or p.reason
            self._point()

    def launched(self, worker: int) -> None:
        with self._lock:
            self.pending.setdefault(worker, _Pending(self.clock()))
            self._point()

    def gone(self, worker: int, *, done: bool = False, dropped: bool = False,
             preempted: bool = False) -> bool:
        """A worker ended; returns whether it was retired (not to be replaced)."""
        with self._lock:
            retired = worker in self.retiring
            self.retiring.discard(worker)
            self.running.discard(worker)
            self.pending.pop(worker, None)
            if (done or dropped) and not retired:
                self.slots_closed += 1
            self.preempted += int(preempted)
            self._point()
            return retired

    def retire(self, workers: tuple[int, ...]) -> None:
        with self._lock:
            self.retiring.update(workers)

    def is_retiring(self, worker: int) -> bool:
        with self._lock:
            return worker in self.retiring

    def resize(self, low: int, high: int, reason: str) -> dict[str, Any]:
        """New bounds (``elasticdl scale``); returns the resize entry."""
        if not 1 <= low <= high:
            raise ValueError(f"expects 1 <= MIN <= MAX, got {low}:{high}")
        with self._lock:
            entry = {"at": round(self.clock(), 3), "from": f"{self.min_workers}:"
                     f"{self.max_workers}", "to": f"{low}:{high}", "reason": reason}
            self.min_workers, self.max_workers = low, high
            self.warned = False
            self.resizes.append(entry)
            self.resizes_total += 1
            del self.resizes[:-MAX_RESIZES]
            self._point()
            return entry

    # ------------------------------------------------------------ queries
    def num_running(self) -> int:
        with self._lock:
            return len(self.running)

    def training(self) -> set[int]:
        """Running workers not being retired (those that push gradients)."""
        with self._lock:
            return self.running - self.retiring

    def num_training(self) -> int:
        return len(self.training())

    def num_pending(self) -> int:
        with self._lock:
            return len(self.pending)

    def pending_reasons(self) -> dict[int, str]:
        with self._lock:
            return {w: p.reason for w, p in self.pending.items()}

    def pending_reason_counts(self) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = {}
            for p in self.pending.values():
                key = p.reason or "(none yet)"
                out[key] = out.get(key, 0) + 1
            return out

    def tick(self) -> float:
        """Update the time under MIN; returns the current stretch's seconds (0 if not)."""
        with self._lock:
            now = self.clock()
            if self.started is None:
                self.started = now
            if len(self.running) < self.min_workers:
                if self.under_min_since is None:
                    self.under_min_since = now
                return now - self.under_min_since
            if self.under_min_since is not None:
                self.under_min_total_s += now - self.under_min_since
                self.under_min_since = None
                self.warned = False
            return 0.0

    def view(self, live: tuple[int, ...], idle: frozenset[int], finishing: bool,
             min_timeout_s: float, fail_on_timeout: bool,
             exporting: bool = False) -> ScalingView:
        under = self.tick()
        with self._lock:
            return ScalingView(self.min_workers, self.max_workers, live,
                               frozenset(self.running & set(live)),
                               {w: p.reason for w, p in self.pending.items() if w in live},
                               frozenset(self.retiring), idle, self.slots_closed, finishing,
                               under, min_timeout_s, fail_on_timeout, self.warned,
                               exporting)

    def _point(self) -> None:
        """Append a timeline point when the counts changed; thin old points."""
        point = [round(self.clock(), 3), len(self.running), len(self.pending), self.preempted]
        if self.timeline and self.timeline[-1][1:] == point[1:]:
            return
        self.timeline.append(point)
        if len(self.timeline) > MAX_POINTS:
            half = MAX_POINTS // 2   # keep the newest half, every other older point
            self.timeline = self.timeline[:half:2] + self.timeline[half:]

    def report(self) -> dict[str, Any]:
        """The ``workers`` section of job_report.json."""
        with self._lock:
            under = self.under_min_total_s
            if self.under_min_since is not None:
                under += self.clock() - self.under_min_since
            return {"min": self.min_workers, "max": self.max_workers,
                    "running": len(self.running), "pending": len(self.pending),
                    "pending_reasons": sorted({p.reason for p in self.pending.values()
                                               if p.reason}),
                    "retiring": sorted(self.retiring), "preempted": self.preempted,
                    "time_under_min_s": round(under, 3),
                    "timeline_columns": ["t", "running", "pending", "preempted"],
                    "timeline": [list(p) for p in self.timeline],
                    "resizes": list(self.resizes), "resizes_total": self.resizes_total}

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"min": self.min_workers, "max": self.max_workers,
                    "running": sorted(self.running),
                    "pending": {str(w): [p.since, p.reason] for w, p in self.pending.items()},
                    "retiring": sorted(self.retiring), "slots_closed": self.slots_closed,
                    "preempted": self.preempted, "timeline": self.timeline,
                    "resizes": self.resizes, "resizes_total": self.resizes_total,
                    "under_min_since": self.under_min_since,
                    "under_min_total_s": self.under_min_total_s,
                    "last_request": self.last_request}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        with self._lock:
            self.min_workers, self.max_workers = int(s["min"]), int(s["max"])
            self.running = set(s["running"])
            self.pending = {int(w): _Pending(float(v[0]), str(v[1]))
                            for w, v in s["pending"].items()}
            self.retiring = set(s["retiring"])
            self.slots_closed, self.preempted = int(s["slots_closed"]), int(s["preempted"])
            self.timeline = [list(p) for p in s["timeline"]]
            self.resizes = list(s["resizes"])
            self.resizes_total = int(s["resizes_total"])
            self.under_min_since = s["under_min_since"]
            self.under_min_total_s = float(s["under_min_total_s"])
            self.last_request = str(s.get("last_request", ""))
