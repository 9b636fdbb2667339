"""Membership of elastic allreduce training: who is in the group, with which rank.

The master runs one :class:`Rendezvous`; its gRPC handlers ``join``,
``get_comm_plan`` and ``report_collective_failure`` call the methods of the
same names, and the job controller calls :meth:`Rendezvous.remove_worker` when
a worker process died. Pure Python: the master never imports torch.

Plans and rounds
----------------
A *plan* (:class:`CommPlan`) is one generation of the group: a version, the
members in rank order (ranks follow worker ids, so they are deterministic), and
the address of the TCPStore that ``torch.distributed`` initialises from.

Any membership change opens a *round*: a join of a worker that is not in the
current plan, a removal, or a failure report against the current plan. While a
round is open every caller gets ``ready=False`` and members stop using the old
group. A worker *checks in* to the round by calling any of the three methods.
The round closes and a new plan is published (lazily, on the next call) when

* ``settle_s`` passed since the last join of the round, if there was one (more
  joins may come; a round opened by a failure or removal alone does not wait, so
  survivors recover as soon as they all checked in), and
* every known worker checked in, or ``checkin_timeout_s`` passed since the round
  opened (a silent worker may be dead; the job controller usually says so first
  through :meth:`remove_worker`), or — once a member failed or was removed —
  every silent worker has not called for ``hung_after_s`` (healthy members poll
  the plan while they wait in a collective, so they abandon the broken plan and
  check in within about a second; one silent that long is hung), and
* for the first plan only, ``initial_workers`` joined or ``checkin_timeout_s``
  passed (avoids a one-member plan while the others are still starting).

The new plan holds the workers that checked in. A worker left out gets
``rank=-1`` with ``ready=True`` and must :meth:`join` again; its id is handed
to the job controller by :meth:`take_excluded`, which kills and relaunches it
(a process that stopped making progress is not trusted to come back).

Bounded failure detection
-------------------------
While a round opened by a failure or a removal is open, every view of the plan
says ``aborting=True``. Members poll the plan while they wait for a collective
(:mod:`elasticdl.common.collective`), so when the job controller removes a worker
whose process exited, or one member's collective failed or timed out, the
others abandon the broken plan within a poll interval instead of waiting for
their own collective timeout.

Store address
-------------
``master_addr`` of a plan is the host its rank-0 worker gave at join (``store_host``
when that host is empty) and ``master_port`` a fresh port from ``port_allocator``.
The rank-0 worker hosts the TCPStore (``is_master=True``) on that port and the others
connect to it, so no torch process runs on the master and workers on different
hosts (Kubernetes pods) work: every pod has its own port space, and on one host
(local processes) the allocator hands out free ports. A fresh port per plan keeps a
stale member of an old plan from ever talking to the new store. If the port turns
out to be taken, store creation fails on the worker, which reports a collective
failure, and the next plan gets another port.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional, Protocol

logger = logging.getLogger(__name__)


class MemberConflict(Exception):
    """A join names a live worker's id from another address."""


@dataclass(frozen=True)
class CommPlan:
    """One worker's view of the current plan (mirrors ``elasticdl.proto.CommPlan``).

    ``rank`` is -1 when the worker is not a member; ``ready`` is False while a
    new plan is forming (ask again soon). ``peer_addresses`` are ``host:port``
    of every rank, in rank order.
    """

    plan_version: int
    rank: int
    world_size: int
    peer_addresses: tuple[str, ...]
    master_addr: str
    master_port: int
    ready: bool
    aborting: bool = False


@dataclass(frozen=True)
class _Published:
    version: int
    members: tuple[int, ...]
    addresses: tuple[str, ...]
    master_addr: str
    master_port: int


@dataclass
class _Round:
    opened_at: float
    reason: str
    last_join: Optional[float] = None
    failed_at: Optional[float] = None   # a member failed or was removed
    checked_in: set[int] = field(default_factory=set)


class RendezvousHandler(Protocol):
    """What the master's servicer and job controller need of a rendezvous
    (:class:`Rendezvous` is the implementation; tests may pass their own)."""

    def join(self, worker_id: int, host: str, port: int) -> CommPlan:
        """A worker asks to be a member; returns its view of the plan.

        Raises:
            MemberConflict: ``worker_id`` is a live member joined from elsewhere.
        """
        ...

    def get_comm_plan(self, worker_id: int, known_version: int) -> CommPlan:
        """The current plan as ``worker_id`` sees it (a check-in)."""
        ...

    def report_failure(self, worker_id: int, plan_version: int, reason: str) -> CommPlan:
        """A member saw a collective of plan ``plan_version`` fail."""
        ...

    def remove_worker(self, worker_id: int) -> None:
        """Forget a worker whose process is gone."""
        ...

    def take_excluded(self) -> list[int]:
        """Workers left out of a plan for not checking in, since the last call."""
        ...

    def state_dict(self) -> dict:
        """Members and the published plan, JSON-able (master failover)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Serve the plan of :meth:`state_dict` (a restarted master)."""
        ...


class Rendezvous:
    """Forms versioned communication plans from joins, failures and removals.

    Args:
        store_host: used as ``master_addr`` when the rank-0 worker joined with
            an empty host.
        port_allocator: returns a port for each new plan's TCPStore.
        settle_s: quiet time after the last join before a plan is published.
        clock: monotonic clock (tests pass a fake).
        checkin_timeout_s: how long an open round waits for known workers that
            have not checked in; use at least the collective timeout.
        initial_workers: members the first plan waits for (up to
            ``checkin_timeout_s``).
        hung_after_s: in a round opened by a failure or removal, a worker that
            has not checked in and has made no call for this long is excluded
            as hung (use the collective timeout; None: only ``checkin_timeout_s``).

    All public methods are thread-safe.
    """

    def __init__(self, store_host: str, port_allocator: Callable[[], int],
                 settle_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 checkin_timeout_s: float = 30.0, initial_workers: int = 1,
                 hung_after_s: Optional[float] = None):
        if settle_s < 0 or checkin_timeout_s < 0 or (hung_after_s or 0) < 0:
            raise ValueError("settle_s, checkin_timeout_s and hung_after_s must be >= 0")
        self._hung_after_s = hung_after_s
        self._excluded: list[int] = []
        self._last_seen: dict[int, float] = {}
        self._store_host = store_host
        self._port_allocator = port_allocator
        self._settle_s = settle_s
        self._clock = clock
        self._checkin_timeout_s = checkin_timeout_s
        self._initial_workers = max(1, initial_workers)
        self._lock = threading.Lock()
        self._workers: dict[int, tuple[str, int]] = {}  # known live workers -> (host, port)
        self._plan: Optional[_Published] = None
        self._round: Optional[_Round] = None
        self._version = 0

    # ------------------------------------------------------------ handlers
    def join(self, worker_id: int, host: str, port: int) -> CommPlan:
        """A worker (new, relaunched, or left out of the last plan) asks to be a member.

        Raises:
            MemberConflict: ``worker_id`` is a live member joined from another
                ``host:port`` (the same address again is an idempotent retry).
        """
        with self._lock:
            now = self._clock()
            known = self._workers.get(worker_id)
            if known is not None and known != (host, int(port)):
                # rank 0's host becomes every member's TCPStore address: a second
                # caller must not redirect a live worker's slot
                raise MemberConflict(
                    f"worker {worker_id} is a live member at {known[0]}:{known[1]}; a join "
                    f"from {host}:{port} may not take its place (a worker left out of a "
                    "plan, or removed, may join again)")
            self._workers[worker_id] = (host, int(port))
            in_round = self._round is not None and worker_id in self._round.checked_in
            if not (in_round and known == (host, int(port))):
                logger.info("rendezvous: worker %d joins from %s:%d", worker_id, host, port)
                self._event(now, f"worker {worker_id} joined", join=True)
            self._check_in(worker_id)
            self._maybe_publish(now)
            return self._view(worker_id)

    def get_comm_plan(self, worker_id: int, known_version: int) -> CommPlan:
        """The current plan as ``worker_id`` sees it; also a check-in to an open round."""
        with self._lock:
            self._check_in(worker_id)
            self._maybe_publish(self._clock())
            return self._view(worker_id)

    def report_failure(self, worker_id: int, plan_version: int, reason: str) -> CommPlan:
        """A member saw a collective of plan ``plan_version`` fail or time out.

        A report against the current plan opens a round; a stale one (an older
        plan, or one already being replaced) only counts as a check-in.
        """
        with self._lock:
            now = self._clock()
            current = self._plan is not None and plan_version == self._plan.version
            if current and worker_id in self._workers and (
                    self._round is None or self._round.failed_at is None):
                logger.warning("rendezvous: worker %d reports plan %d failed: %s", worker_id,
                               plan_version, reason)
                self._event(now, f"worker {worker_id}: {reason}", failure=True)
            self._check_in(worker_id)
            self._maybe_publish(now)
            return self._view(worker_id)

    def remove_worker(self, worker_id: int) -> None:
        """Forget a worker whose process is gone (the job controller calls this)."""
        with self._lock:
            if self._workers.pop(worker_id, None) is None:
                return
            now = self._clock()
            if self._round is not None:
                self._round.checked_in.discard(worker_id)
            if self._round is not None or (self._plan and worker_id in self._plan.members):
                logger.info("rendezvous: worker %d removed", worker_id)
                self._event(now, f"worker {worker_id} removed", failure=True)
            self._maybe_publish(now)

    def members(self) -> list[int]:
        """Worker ids of the current published plan, in rank order."""
        with self._lock:
            self._maybe_publish(self._clock())
            return list(self._plan.members) if self._plan else []

    @property
    def plan_version(self) -> int:
        """Version of the last published plan (0 before the first)."""
        with self._lock:
            return self._version

    def take_excluded(self) -> list[int]:
        """Workers left out of a plan for not checking in (hung) since the last call."""
        with self._lock:
            self._maybe_publish(self._clock())
            out, self._excluded = self._excluded, []
            return out

    def forming(self) -> bool:
        """True while a round is open (no ready plan)."""
        with self._lock:
            self._maybe_publish(self._clock())
            return self._round is not None

    # --------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """The members and the published plan (master failover: a restored master
        serves the same plan, so its members train on undisturbed)."""
        with self._lock:
            plan = self._plan
            return {"version": self._version,
                    "workers": {str(w): list(a) for w, a in self._workers.items()},
                    "plan": None if plan is None else {
                        "version": plan.version, "members": list(plan.members),
                        "addresses": list(plan.addresses), "master_addr": plan.master_addr,
                        "master_port": plan.master_port}}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            now = self._clock()
            self._version = int(state["version"])
            self._workers = {int(w): (str(a[0]), int(a[1])) for w, a in state["workers"].items()}
            self._last_seen = {w: now for w in self._workers}
            p = state["plan"]
            self._plan = None if p is None else _Published(
                int(p["version"]), tuple(p["members"]), tuple(p["addresses"]),
                str(p["master_addr"]), int(p["master_port"]))
            self._round = None

    # ----------------------------------------------------------- internals
    def _event(self, now: float, reason: str, join: bool = False,
               failure: bool = False) -> None:
        if self._round is None:
            self._round = _Round(opened_at=now, reason=reason)
        if join:
            self._round.last_join = now
        if failure and self._round.failed_at is None:
            self._round.failed_at = now

    def _check_in(self, worker_id: int) -> None:
        self._last_seen[worker_id] = self._clock()
        if self._round is not None and worker_id in self._workers:
            self._round.checked_in.add(worker_id)

    def _maybe_publish(self, now: float) -> None:
        rnd = self._round
        if rnd is None:
            return
        checked = rnd.checked_in & set(self._workers)
        if not checked:
            return
        if rnd.last_join is not None and now - rnd.last_join < self._settle_s:
            return
        timed_out = now - rnd.opened_at >= self._checkin_timeout_s or (
            rnd.failed_at is not None and self._hung_after_s is not None and all(
                now - self._last_seen.get(w, rnd.opened_at) >= self._hung_after_s
                for w in set(self._workers) - checked))
        if checked != set(self._workers) and not timed_out:
            return
        if self._plan is None and len(checked) < self._initial_workers and not timed_out:
            return
        members = tuple(sorted(checked))
        for dropped in sorted(set(self._workers) - checked):
            logger.warning("rendezvous: worker %d did not check in within %.1f s; left out "
                           "as hung (it must join again)", dropped, now - rnd.opened_at)
            del self._workers[dropped]
            self._excluded.append(dropped)
        self._version += 1
        host0 = self._workers[members[0]][0] or self._store_host
        self._plan = _Published(
            version=self._version, members=members,
            addresses=tuple(f"{self._workers[w][0]}:{self._workers[w][1]}" for w in members),
            master_addr=host0, master_port=int(self._port_allocator()))
        self._round = None
        logger.info("rendezvous: plan %d published: workers %s, store %s:%d (%s; formed in "
                    "%.2f s)", self._version, list(members), host0, self._plan.master_port,
                    rnd.reason, now - rnd.opened_at)

    def _view(self, worker_id: int) -> CommPlan:
        plan = self._plan
        ready = self._round is None and plan is not None
        if plan is None:
            return CommPlan(self._version, -1, 0, (), "", 0, False)
        rank = plan.members.index(worker_id) if worker_id in plan.members else -1
        aborting = self._round is not None and self._round.failed_at is not None
        return CommPlan(plan.version, rank, len(plan.members), plan.addresses,
                        plan.master_addr, plan.master_port, ready, aborting)
