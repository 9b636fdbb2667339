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
* **Time to live**: a row not updated (nor created) for ``ttl_versions`` model versions
  is evicted by the sweep, which visits ``sweep_rows`` slots per model version, so a row
  goes at most ``size / sweep_rows`` versions after its time.
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

    def __post_init__(self) -> None:
        if self.admit_after < 1 or self.ttl_versions < 0 or self.max_rows < 0 or \
                self.sketch_counters < 64 or self.sweep_rows < 1:
            raise ValueError(f"bad table policy {self}: admit_after >= 1, ttl_versions >= 0, "
                             "max_rows >= 0, sketch_counters >= 64, sweep_rows >= 1")

    @property
    def admits(self) -> bool:
        return self.admit_after > 1

    @property
    def evicts(self) -> bool:
        return self.ttl_versions > 0 or self.max_rows > 0


@dataclass(frozen=True)
class EmbeddingDefaults:
    """The job's defaults for tables whose layer does not set them (the flags)."""

    admit_after: int = 1
    ttl_versions: int = 0
    max_rows: int = 0         # for the whole job; each PS holds its share
    sketch_counters: int = 1 << 22
    sweep_rows: int = 1 << 16

    def policy(self, spec_admit: int | None, spec_ttl: int | None, spec_max: int | None,
               num_ps: int) -> TablePolicy:
        """The policy of a table on one of ``num_ps`` PS (a table's own setting wins)."""
        admit = self.admit_after if spec_admit is None else spec_admit
        ttl = self.ttl_versions if spec_ttl is None else spec_ttl
        most = self.max_rows if spec_max is None else spec_max
        per_ps = -(-most // num_ps) if most > 0 else 0
        return TablePolicy(max(admit, 1), ttl, per_ps, self.sketch_counters, self.sweep_rows)


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
