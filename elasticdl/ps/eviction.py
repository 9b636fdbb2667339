"""Which embedding rows a table admits and evicts: per-table policy and victim choice.

A table's policy comes from its layer (``Embedding(..., admit_after=, ttl_versions=,
max_rows=)``, carried by :class:`~elasticdl.common.tables.TableSpec`) or, where the layer
leaves it unset, from the job's flags (``--embedding_admit_after``,
``--embedding_ttl_versions``, ``--embedding_max_rows``). It applies to every PS table:
a lazy one (rows from its initializer) and one whose rows were pushed whole (a
materialised ``Embedding``, a torch ``nn.Embedding``): a row of the latter evicted or not
admitted yet answers zeros.

* **Admission** (:mod:`elasticdl.ps.admission`): an id gets a row on its
  ``admit_after``-th training pull; before, its lookup answers the initializer's row for
  that id (the value the row will start from; zeros with ``initializer="zeros"``, and for
  a table pushed whole) and gradients pushed for it are dropped (counted in
  ``grads_dropped``). A table pushed whole has every row at the start: admission gates
  only the rows created again after an eviction.
* **Time to live**: a row not updated (nor created) for ``ttl_versions`` model versions,
  or for ``ttl_seconds`` seconds, is evicted by the sweep, which visits ``sweep_rows``
  slots per model version, so a row goes at most ``size / sweep_rows`` versions after
  its time. Seconds cost no per-row clock: a row's last-update model version is all a row
  keeps, and a :class:`VersionClock` per table records when versions began (a bounded
  record) and turns the seconds into a version before which every update is at least
  that old.
* **Capacity**: at most ``max_rows`` rows per table on this PS (the layer's and the
  flag's figure is for the whole job, split evenly over the PS). Creating rows beyond it
  first evicts the least recently updated rows (LRU by the same last-update version the
  TTL reads: one uint32 per row serves both; LFU would need a second counter per row and
  keeps the old heavy hitters of a drifted stream until they age out), plus 1/64 of the
  bound as slack so that evictions come in batches. The choice is exact for tables of up
  to ``LRU_EXACT_ROWS`` rows, and above it the oldest among ``LRU_SAMPLE`` random rows per
  victim (Redis's approximated LRU): bounded work, no global order to maintain.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import numpy as np

LRU_EXACT_ROWS = 1 << 16
LRU_SAMPLE = 16


@dataclass(frozen=True)
class TablePolicy:
    """Admission and eviction of one table on one PS (all off: today's behaviour)."""

    admit_after: int = 1      # rows for ids seen this many times (1: at once)
    ttl_versions: int = 0     # evict rows not updated for this many versions (0: never)
    max_rows: int = 0         # rows of the table on this PS (0: unbounded)
    sketch_counters: int = 1 << 22   # admission sketch bytes
    sweep_rows: int = 1 << 16        # slots the TTL sweep visits per model version
    ttl_seconds: float = 0.0  # evict rows not updated for this many seconds (0: never)

    def __post_init__(self) -> None:
        if self.admit_after < 1 or self.ttl_versions < 0 or self.max_rows < 0 or \
                self.sketch_counters < 64 or self.sweep_rows < 1 or \
                not self.ttl_seconds >= 0:
            raise ValueError(f"bad table policy {self}: admit_after >= 1, ttl_versions >= 0, "
                             "max_rows >= 0, sketch_counters >= 64, sweep_rows >= 1, "
                             "ttl_seconds >= 0")

    @property
    def admits(self) -> bool:
        return self.admit_after > 1

    @property
    def evicts(self) -> bool:
        return self.ttl_versions > 0 or self.max_rows > 0 or self.ttl_seconds > 0


@dataclass(frozen=True)
class EmbeddingDefaults:
    """The job's defaults for tables whose layer does not set them (the flags)."""

    admit_after: int = 1
    ttl_versions: int = 0
    max_rows: int = 0         # for the whole job; each PS holds its share
    sketch_counters: int = 1 << 22
    sweep_rows: int = 1 << 16
    ttl_seconds: float = 0.0

    def policy(self, spec_admit: int | None, spec_ttl: int | None, spec_max: int | None,
               num_ps: int, spec_ttl_s: float | None = None) -> TablePolicy:
        """The policy of a table on one of ``num_ps`` PS (a table's own setting wins)."""
        admit = self.admit_after if spec_admit is None else spec_admit
        ttl = self.ttl_versions if spec_ttl is None else spec_ttl
        ttl_s = self.ttl_seconds if spec_ttl_s is None else spec_ttl_s
        most = self.max_rows if spec_max is None else spec_max
        per_ps = -(-most // num_ps) if most > 0 else 0
        return TablePolicy(max(admit, 1), ttl, per_ps, self.sketch_counters, self.sweep_rows,
                           float(ttl_s))


class VersionClock:
    """When model versions began on this PS, for a TTL in seconds (see the module doc).

    :meth:`mark` is told each new version; a mark ``(v, t)`` says version ``v`` had begun
    by ``t``, so every row whose last update was stamped with a version below ``v`` was
    last updated before ``t``. Bounded: a mark closer than ``ttl_s / resolution`` to the
    previous one is not kept (a row goes at most that much after its time), and marks
    older than the newest one at least ``ttl_s`` old are dropped: at most
    ``resolution + 2`` marks, whatever the job's length. Not checkpointed: the rows keep
    their last-update versions across a restore, but this record starts anew there, so
    a restored PS evicts nothing by time until ``ttl_s`` after its restore.
    """

    def __init__(self, ttl_s: float, resolution: int = 512,
                 clock: Callable[[], float] = time.monotonic):
        if not ttl_s > 0 or resolution < 1:
            raise ValueError(f"VersionClock needs ttl_s > 0 and resolution >= 1, got {ttl_s}, "
                             f"{resolution}")
        self.ttl_s = float(ttl_s)
        self.gap = self.ttl_s / resolution
        self.clock = clock
        self.marks: deque[tuple[int, float]] = deque()

    def mark(self, version: int) -> None:
        """``version`` is the model version from now on."""
        now = self.clock()
        while self.marks and self.marks[-1][0] >= version:
            self.marks.pop()    # the version went back (a rollback): later marks are void
        if self.marks and now - self.marks[-1][1] < self.gap:
            return
        self.marks.append((int(version), now))
        horizon = now - self.ttl_s
        while len(self.marks) >= 2 and self.marks[1][1] <= horizon:
            self.marks.popleft()

    def cut(self) -> Optional[int]:
        """The newest marked version that began ``ttl_s`` or more ago (None: none did):
        rows stamped below it were last updated at least ``ttl_s`` ago."""
        horizon = self.clock() - self.ttl_s
        found = None
        for version, began in self.marks:
            if began > horizon:
                break
            found = version
        return found

    def ttl_versions(self, now: int) -> int:
        """The TTL in versions at model version ``now`` (0: nothing is that old yet)."""
        cut = self.cut()
        return 0 if cut is None or cut > now else now - cut + 1


def ttl_victims(touched: np.ndarray, row_ids: np.ndarray, lo: int, hi: int, now: int,
                ttl: int) -> np.ndarray:
    """Slots in ``[lo, hi)`` holding a row last updated ``ttl`` or more versions ago."""
    age = now - touched[lo:hi].astype(np.int64)
    return lo + np.flatnonzero((row_ids[lo:hi] >= 0) & (age >= ttl))


def lru_victims(touched: np.ndarray, row_ids: np.ndarray, size: int, need: int,
                rng: np.random.Generator, keep: Optional[np.ndarray] = None) -> np.ndarray:
    """``need`` slots among the least recently updated rows of ``[0, size)``, never one
    in ``keep`` (see the module doc: exact up to ``LRU_EXACT_ROWS`` rows, else sampled)."""
    if need <= 0:
        return np.zeros(0, dtype=np.int64)
    cand = None
    if size > max(LRU_EXACT_ROWS, need * LRU_SAMPLE):
        cand = np.unique(rng.integers(0, size, need * LRU_SAMPLE))
        cand = cand[row_ids[cand] >= 0]
        if keep is not None and keep.shape[0]:
            cand = cand[~np.isin(cand, keep)]
        if cand.shape[0] < need:
            cand = None
    if cand is None:
        cand = np.flatnonzero(row_ids[:size] >= 0)
        if keep is not None and keep.shape[0]:
            cand = cand[~np.isin(cand, keep)]
    if cand.shape[0] <= need:
        return cand
    ages = touched[cand]
    return cand[np.argpartition(ages, need - 1)[:need]]
