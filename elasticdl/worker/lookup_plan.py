"""A step's embedding rows pulled together, before the model's forward asks for them.

A model looks its tables up one after another (facebookresearch/dlrm: 26
``nn.EmbeddingBag`` in a loop; DeepCTR-Torch: a table per field, twice), and each
lookup of a PS table is a round trip to the PS: in a DLRM PS job, 26 sequential round
trips were 80% of a worker's step. The ids a table is looked up with are almost always
a tensor of the minibatch's features (DLRM's ``lS_i[k]``) or a column of one made
integer (DeepCTR's ``X[:, i:i + 1].long()``).

:class:`LookupPlan` learns, from a step's lookups, where in the features each table's
ids come from (a whole tensor, or columns ``[lo, hi)`` of a 2-D one, equal by value).
From the next step on :meth:`LookupPlan.prefetch` takes every planned table's ids from
the features and pulls all their rows in one call per PS
(:meth:`~elasticdl.worker.ps_client.PSClient.pull_embeddings_unique`) before the forward.
Each lookup then checks that its own unique ids are exactly the prefetched ones and uses
those rows; otherwise it pulls its own, as without a plan, and the table leaves the plan
(a warning; a table is searched for in at most ``MAX_LEARN`` steps). A wrong plan costs
one pull, never a wrong row. A planned table the step did not look up leaves the plan
too (its prefetched rows unused).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np
import torch

from elasticdl.worker.nested import Path, leaves

logger = logging.getLogger(__name__)

MAX_LEARN = 3          # steps a table is searched for before it is pulled on its own
MAX_COLUMNS = 4096     # wider 2-D feature tensors are not searched for id columns



@dataclass(frozen=True)
class Source:
    """Where a table's ids are in the features: the tensor at ``path``, whole
    (``lo < 0``) or its columns ``[lo, hi)``."""

    path: Path
    lo: int = -1
    hi: int = -1

    def ids(self, features: Any) -> Optional[np.ndarray]:
        """The ids (flat int64), or None where the features have no such tensor."""
        t = _at(features, self.path)
        if not isinstance(t, torch.Tensor):
            return None
        if self.lo >= 0:
            if t.dim() != 2 or t.shape[1] < self.hi:
                return None
            t = t[:, self.lo:self.hi]
        return t.detach().reshape(-1).to(torch.int64).cpu().numpy()


class Puller(Protocol):
    def start_pull_embeddings(self, tables: Any,
                              create: bool = True) -> Callable[[], list[torch.Tensor]]:
        ...


def _at(obj: Any, path: Path) -> Any:
    for key in path:
        try:
            obj = obj[key]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


def find_source(features: Any, ids: torch.Tensor) -> Optional[Source]:
    """Where ``ids`` are in ``features`` (by value): a tensor equal to them, else
    columns of a 2-D tensor that, made integer, are; None if nowhere."""
    want = ids.detach().to(torch.int64).cpu()
    found = list(leaves(features))
    for path, t in found:
        if t is ids or (t.shape == ids.shape and
                        torch.equal(t.detach().to(torch.int64).cpu(), want)):
            return Source(path)
    if want.dim() == 0:
        return None
    cols = want.reshape(want.shape[0], -1)
    width = cols.shape[1]
    for path, t in found:
        if t.dim() != 2 or t.shape[0] != cols.shape[0] or not width <= t.shape[1] <= MAX_COLUMNS:
            continue
        as_int = t.detach().cpu().to(torch.int64)
        for lo in range(t.shape[1] - width + 1):
            if torch.equal(as_int[:, lo:lo + width], cols):
                return Source(path, lo, lo + width)
    return None


class LookupPlan:
    """The tables of one model whose ids come from the features (see the module doc)."""

    def __init__(self) -> None:
        self.plan: dict[str, tuple[Source, int, torch.dtype]] = {}
        self._learned: dict[str, int] = {}     # times each table was learned
        self._features: Any = None
        self._rows: dict[str, tuple[np.ndarray, torch.Tensor]] = {}
        self._pending: Optional[Callable[[], None]] = None
        self.prefetched = self.hits = self.misses = 0

    @property
    def started(self) -> bool:
        """A prefetch for the step under way was started."""
        return self._features is not None

    def prefetch(self, features: Any, client: Puller, create: bool) -> None:
        """Start pulling every planned table's rows for ``features`` (one call per PS,
        concurrently with whatever the caller does next: the dense pull); the lookups
        wait for them."""
        self._features = features
        self._rows = {}
        self._pending = None
        wanted = []
        for table, (source, dim, dtype) in list(self.plan.items()):
            ids = source.ids(features)
            if ids is None:
                self._drop(table, "the features have no tensor at its place")
                continue
            wanted.append((table, np.unique(ids), dim, dtype))
        if not wanted:
            return
        wait = client.start_pull_embeddings(wanted, create=create)

        def arrive() -> None:
            self._rows = {t: (uniq, r) for (t, uniq, _, _), r in zip(wanted, wait())}

        self._pending = arrive
        self.prefetched += len(wanted)

    def take(self, table: str, ids: torch.Tensor, uniq: np.ndarray, dim: int,
             dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The prefetched rows of ``table`` if they are those of ``uniq`` (else None:
        the caller pulls); a table not planned yet is learned from ``ids``."""
        if self._pending is not None:   # (raises what the pull raised)
            arrive, self._pending = self._pending, None
            arrive()
        got = self._rows.pop(table, None)
        if got is not None:
            if np.array_equal(got[0], uniq):
                self.hits += 1
                return got[1]
            self.misses += 1
            self._drop(table, "its ids were not the prefetched ones")
            return None
        if table not in self.plan and self._features is not None and \
                self._learned.get(table, 0) < MAX_LEARN:
            # (every attempt counts: a table whose ids are computed is searched for at
            # most MAX_LEARN steps, not every step)
            self._learned[table] = self._learned.get(table, 0) + 1
            source = find_source(self._features, ids)
            if source is not None:
                self.plan[table] = (source, dim, dtype)
        return None

    def end_step(self) -> None:
        """A planned table not looked up in this step leaves the plan."""
        for table in list(self._rows):
            self._drop(table, "the step did not look it up")
        self._rows = {}
        self._features = None
        self._pending = None

    def _drop(self, table: str, why: str) -> None:
        if self.plan.pop(table, None) is not None:
            logger.warning("table %r: pulled on its own from now on (%s)", table, why)
