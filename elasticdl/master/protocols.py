"""Multi-step recoveries as open records of the job core (DESIGN §6c).

A protocol is a record ``(id, kind, step, data)`` in the job core's state.
Each step change is a journaled core transition written *before* the side
effect it names (:mod:`elasticdl.master.recovery`); the pure ``next_*``
functions here decide, from the record and what the controller observes, the
one action to take next; the :class:`~elasticdl.master.executor.ProtocolExecutor`
applies it. A restarted master restores the records with the rest of the core
and goes on from the step each one is at. No torch, no I/O.

PS rollback (``rollback``)::

    REQUESTED(launch=[ps...], source) -> PS_LAUNCHED -> ROLLING_BACK(new_version,
    incarnation) -> REQUEUED -> closed

A divergence rollback (``--on_divergence=rollback``) is the same protocol with no PS
to launch and ``set_aside``: the checkpoint versions above its source, written by the
diverged model, are set aside (``diverged-version-N``) when it launches and again
when it closes, so no later rollback, resume or export takes one.

A lone recovery (``--ps_recovery=alone``, the default, when the checkpoint is the
run's own) is the same protocol with ``alone`` in its data: only the PS it launched
(``restore``, every PS lost while it is open) restore the checkpoint at the
ROLLING_BACK step; the others keep their state and versions and are told the new
ledger generation; REQUEUED re-queues what the restored PS lack (the others hold it
and skip its redo by their ledgers).

A PS that dies while one is open joins it (back to REQUESTED, the same
source): two PS deaths, or a PS and a master death, in any order, end in one
rollback of every PS to one checkpoint. A ROLLING_BACK step taken by an
earlier master incarnation is not trusted (some PS may have rolled back, then
moved on): the new master chooses a new version and rolls every PS back again,
which gives the same state (the checkpoint) and re-queues a superset of the
work, and the PS ledgers keep what is applied from being applied twice.

Final export (``export``)::

    OPEN -> CLAIMED(worker) -> WRITTEN(path) -> closed

An exporter that dies before WRITTEN puts the export back to OPEN; the next
worker to ask claims it (workers that finished wait while the export is
open), and when no worker is left one is launched for it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional


class Kind(str, enum.Enum):
    ROLLBACK = "rollback"
    EXPORT = "export"


class Step(str, enum.Enum):
    REQUESTED = "requested"
    PS_LAUNCHED = "ps_launched"
    ROLLING_BACK = "rolling_back"
    REQUEUED = "requeued"
    OPEN = "open"
    CLAIMED = "claimed"
    WRITTEN = "written"


@dataclass
class Protocol:
    """One open protocol. ``seq`` counts its step changes (a result computed for
    an older step is stale); ``incarnation``: the master that took the step."""

    pid: int
    kind: Kind
    step: Step
    data: dict[str, Any] = field(default_factory=dict)
    seq: int = 0
    incarnation: int = 0
    opened_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "kind": self.kind.value, "step": self.step.value,
                "data": self.data, "seq": self.seq, "incarnation": self.incarnation,
                "opened_at": self.opened_at}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Protocol:
        return cls(int(d["pid"]), Kind(d["kind"]), Step(d["step"]), dict(d["data"]),
                   int(d["seq"]), int(d["incarnation"]), float(d.get("opened_at", 0.0)))


class ProtocolBook:
    """The open protocols, the master incarnation, and what closed ones left
    behind that the job needs (the exported model's path; counts). Its size is
    the number of open protocols, never the job's history. Not thread-safe:
    the job core calls it under its lock."""

    def __init__(self) -> None:
        self.open: dict[int, Protocol] = {}
        self.next_id = 1
        self.incarnation = 0
        self.exported: Optional[str] = None
        self.rollbacks_done = 0
        self.export_attempts = 0
        self.divergence_rollbacks = 0   # --on_divergence=rollback's: the LR scale's exponent

    def find(self, kind: Kind) -> Optional[Protocol]:
        return next((p for p in self.open.values() if p.kind == kind), None)

    def start(self, kind: Kind, step: Step, data: dict[str, Any], now: float) -> Protocol:
        p = Protocol(self.next_id, kind, step, data, 0, self.incarnation, now)
        self.next_id += 1
        self.open[p.pid] = p
        return p

    def step(self, pid: int, step: Step, **data: Any) -> Protocol:
        p = self.open[pid]
        p.step = step
        p.data.update(data)
        p.seq += 1
        p.incarnation = self.incarnation
        return p

    def close(self, pid: int) -> Protocol:
        return self.open.pop(pid)

    def state_dict(self) -> dict[str, Any]:
        return {"open": [p.to_json() for p in self.open.values()], "next_id": self.next_id,
                "incarnation": self.incarnation, "exported": self.exported,
                "rollbacks_done": self.rollbacks_done,
                "export_attempts": self.export_attempts,
                # only once there is one: a journal of before (v1) reads back unchanged
                **({"divergence_rollbacks": self.divergence_rollbacks}
                   if self.divergence_rollbacks else {})}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        state = state or {}
        self.open = {int(d["pid"]): Protocol.from_json(d) for d in state.get("open", [])}
        self.next_id = int(state.get("next_id", 1))
        self.incarnation = int(state.get("incarnation", 0))
        self.exported = state.get("exported")
        self.rollbacks_done = int(state.get("rollbacks_done", 0))
        self.export_attempts = int(state.get("export_attempts", 0))
        self.divergence_rollbacks = int(state.get("divergence_rollbacks", 0))


# ------------------------------------------------------------------ decisions
class Act(str, enum.Enum):
    WAIT = "wait"                   # nothing to do this pass
    LAUNCH_PS = "launch_ps"         # journal PS_LAUNCHED, then create the PS
    CHOOSE_VERSION = "choose"       # read every PS's version, journal ROLLING_BACK(v)
    RECHOOSE = "rechoose"           # journal PS_LAUNCHED again (an older master's step)
    ROLLBACK_ALL = "rollback_all"   # send the rollback RPCs, journal REQUEUED
    CLOSE = "close"                 # journal the close
    EXPORT_LOST = "export_lost"     # journal OPEN again: the exporter is gone
    LAUNCH_EXPORTER = "launch_exporter"   # no worker left: launch one for the export
    FAIL = "fail"                   # a documented budget is exhausted


@dataclass(frozen=True)
class Action:
    act: Act
    reason: str = ""


@dataclass(frozen=True)
class Observed:
    """What the controller sees now: the master incarnation, the live workers,
    the clock (seconds, the protocols' ``opened_at`` scale), the budgets."""

    incarnation: int
    live_workers: frozenset[int] = frozenset()
    now: float = 0.0
    rollback_budget_s: float = 600.0
    max_export_attempts: int = 3
    can_launch_exporter: bool = True   # False: only workers that trained hold the model


def next_rollback(p: Protocol, seen: Observed) -> Action:
    if seen.now - p.opened_at > seen.rollback_budget_s:
        return Action(Act.FAIL, f"PS rollback to checkpoint {p.data.get('checkpoint')} not "
                      f"done within {seen.rollback_budget_s:.0f} s (rollback budget)")
    if p.step == Step.REQUESTED:
        return Action(Act.LAUNCH_PS)
    if p.step == Step.PS_LAUNCHED:
        return Action(Act.CHOOSE_VERSION)
    if p.step == Step.ROLLING_BACK:
        if p.incarnation != seen.incarnation:
            return Action(Act.RECHOOSE, "taken by an earlier master")
        return Action(Act.ROLLBACK_ALL)
    return Action(Act.CLOSE)


def next_export(p: Protocol, seen: Observed, attempts: int) -> Action:
    if p.step == Step.WRITTEN:
        return Action(Act.CLOSE)
    if p.step == Step.CLAIMED and p.data["worker"] not in seen.live_workers:
        return Action(Act.EXPORT_LOST, f"exporter worker-{p.data['worker']} is gone")
    if p.step == Step.OPEN and not seen.live_workers:
        if not seen.can_launch_exporter:
            return Action(Act.FAIL, "the final export: no live worker holds the trained "
                          "model (every member that trained is gone; export budget)")
        if attempts >= seen.max_export_attempts:
            return Action(Act.FAIL, f"the final export's exporter died {attempts} time(s) "
                          f"(export budget {seen.max_export_attempts})")
        return Action(Act.LAUNCH_EXPORTER)
    return Action(Act.WAIT)


def next_action(p: Protocol, seen: Observed, export_attempts: int = 0) -> Action:
    if p.kind == Kind.ROLLBACK:
        return next_rollback(p, seen)
    return next_export(p, seen, export_attempts)
