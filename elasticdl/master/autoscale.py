"""``--autoscale=F``: grow toward MAX only while each added worker pays for itself.

DLRover-style throughput-driven sizing, within ``--num_workers=MIN:MAX``. The job
starts at MIN. The master measures the job's training throughput (records
completed per second, from the task ledger) at the current size, adds one
worker, waits until it runs and the rate has settled, and measures again:

* the added worker raised throughput by at least ``F`` times the per-worker
  throughput before it: it stays, and the next one is tried (up to MAX);
* it did not (a PS, the network or shared storage is the bottleneck): it is
  given back (retired the ordinary way: it finishes or returns its task, so no
  record is lost or trained twice) and the size holds for ``hold_s`` before the
  next probe, since what limits throughput may change;
* it never started running within ``start_timeout_s`` (no capacity): it is given
  back too (its pending pod cancelled) and the size holds.

Each decision is an ordinary resize (``JobCore.resize_workers``: journaled, in
the report's ``workers.resizes`` with its reason, so a restarted master keeps
the size); the measurements themselves are not journaled: a restarted master
measures the current size again. Its state is one rate per size tried (at most
MAX entries) and a few scalars.

Pure logic here (an injected clock and counters); :mod:`elastic_control` applies it.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Optional

logger = logging.getLogger(__name__)


REASON = "autoscale"   # every resize this module asks for has a reason starting so


def is_autoscale(reason: str) -> bool:
    """Whether a resize's reason is the autoscaler's (not a user's ``elasticdl scale``)."""
    return reason.startswith(REASON)


class Phase(str, enum.Enum):
    SETTLE = "settle"     # waiting for the target size to run and the rate to settle
    MEASURE = "measure"   # measuring the rate at the target size
    HOLD = "hold"         # size decided; probe again later


@dataclass
class AutoScaler:
    fraction: float        # an added worker must add this x the per-worker rate before it
    floor: int             # MIN
    ceiling: int           # MAX
    settle_s: float = 10.0
    window_s: float = 20.0
    start_timeout_s: float = 180.0
    hold_s: float = 300.0
    target: int = 0
    phase: Phase = Phase.SETTLE
    since: float = 0.0                 # when the phase (or the wait for the size) began
    grown: bool = False                # the target was reached by adding a worker
    rates: dict[int, float] = field(default_factory=dict)   # records/s per size tried
    _mark: tuple[float, int] = (0.0, 0)  # (time, records) at the window's start
    _reached: Optional[float] = None     # when the running count reached the target

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"--autoscale expects a fraction in (0, 1], got {self.fraction}")
        self.target = self.target or self.floor

    def rebound(self, floor: int, ceiling: int, now: float) -> int:
        """New bounds (``elasticdl scale``): the size stays where it is, within them,
        and is measured again from there. Returns the target."""
        self.floor, self.ceiling = floor, ceiling
        self.target = min(max(self.target, floor), ceiling)
        self.rates.clear()
        self._enter(Phase.SETTLE, now, grown=False)
        return self.target

    def _enter(self, phase: Phase, now: float, grown: Optional[bool] = None) -> None:
        self.phase, self.since = phase, now
        if grown is not None:
            self.grown = grown

    def step(self, now: float, records: int, running: int) -> Optional[tuple[int, str]]:
        """One look at the job: ``records`` training records completed so far,
        ``running`` workers training. Returns ``(new target, reason)`` when the
        size should change, else None."""
        if self.phase == Phase.HOLD:
            if now - self.since < self.hold_s:
                return None
            self.rates.clear()   # what limited the rate may have changed: measure again
            self._enter(Phase.SETTLE, now, grown=False)
        if running != self.target:
            self._reached = None
            if self.phase == Phase.MEASURE:   # a worker left or was preempted: start over
                self._enter(Phase.SETTLE, now)
            if self.grown and running < self.target and \
                    now - self.since > self.start_timeout_s:
                return self._give_back(now, f"worker {self.target} not running after "
                                       f"{self.start_timeout_s:.0f} s (no capacity)")
            return None
        if self.phase == Phase.SETTLE:
            if self._reached is None:
                self._reached = now
            if now - self._reached >= self.settle_s:
                self._enter(Phase.MEASURE, now)
                self._mark = (now, records)
            return None
        t0, r0 = self._mark
        if now - t0 < self.window_s:
            return None
        rate = (records - r0) / (now - t0)
        self.rates[self.target] = rate
        before = self.rates.get(self.target - 1)
        if self.grown and before is not None:
            per_worker = before / (self.target - 1)
            gain = rate - before
            if gain < self.fraction * per_worker:
                return self._give_back(now, f"worker {self.target} added {gain:.1f} records/s "
                                       f"({rate:.1f} at {self.target}, {before:.1f} at "
                                       f"{self.target - 1}), under {self.fraction:g} x "
                                       f"{per_worker:.1f} per worker")
        if self.target >= self.ceiling:
            self._enter(Phase.HOLD, now)
            logger.info("%s: %.1f records/s at %d workers (MAX)", REASON, rate, self.target)
            return None
        self.target += 1
        self._enter(Phase.SETTLE, now, grown=True)
        return self.target, (f"{REASON}: {rate:.1f} records/s at {self.target - 1} "
                             f"worker(s); trying {self.target}")

    def _give_back(self, now: float, why: str) -> tuple[int, str]:
        self.rates.pop(self.target, None)
        self.target -= 1
        self._enter(Phase.HOLD, now, grown=False)
        return self.target, f"{REASON}: {why}: given back, holding {self.target}"

    def state(self) -> dict[str, object]:
        """For the report: the size, the phase and the rates measured."""
        return {"fraction": self.fraction, "target": self.target, "phase": self.phase.value,
                "rates": {str(k): round(v, 1) for k, v in sorted(self.rates.items())}}
