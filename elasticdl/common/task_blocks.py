"""Task ids that name their task: blocks of consecutive ids over a piece source (the master's
task manager makes them, a checkpoint's data position records them, hence here).

An epoch of a million tasks is never materialised. Creating it reserves a
*block* of ids ``[base, base + count)``; the task with id ``base + p`` is piece
``perm(p)`` of the block's source (``perm``: a seeded pseudo-random
permutation when the job shuffles, else the identity), so any task of the
block can be rebuilt from its id, and the queue of a block is one integer, the
next position to hand out. Sources:

* :class:`PieceSource` cuts ``(name, start, count)`` shards into pieces of
  ``records_per_task`` records on demand (O(shards) memory, not O(pieces));
* an explicit list of ``(name, start, end, epoch)`` pieces (the pending ranges
  of a resumed data position, a finalize task): ranges no rule derives.

No torch. JSON form of a block: :meth:`Block.to_json`.
"""

from __future__ import annotations

import random
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from elasticdl.common.task import Task, TaskType

_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a 64-bit integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Permutation:
    """A seeded pseudo-random permutation of ``range(n)`` evaluated point by point
    (a 4-round Feistel network on the smallest even bit width that covers ``n``,
    cycle-walking back into range): O(1) memory and time per position."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int):
        self.n = n
        bits = max(2, (max(n, 1) - 1).bit_length())
        bits += bits % 2
        self._half = bits // 2
        self._mask = (1 << self._half) - 1
        rnd = random.Random(seed)
        self._keys = [rnd.getrandbits(64) for _ in range(self.ROUNDS)]

    def _round_trip(self, x: int) -> int:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def __call__(self, p: int) -> int:
        if not 0 <= p < self.n:
            raise IndexError(f"position {p} outside a permutation of {self.n}")
        x = self._round_trip(p)
        while x >= self.n:
            x = self._round_trip(x)
        return x


class PieceSource(Sequence[tuple[str, int, int]]):
    """``(name, start, count)`` shards cut into ``(name, start, end)`` pieces of at
    most ``records_per_task`` records, piece ``i`` computed on demand."""

    def __init__(self, shards: Iterable[Sequence[Any]], records_per_task: int):
        self.shards = [(str(n), int(s), int(c)) for n, s, c in shards]
        self.records_per_task = records_per_task
        self._cum = [0]
        for _, _, count in self.shards:
            self._cum.append(self._cum[-1] + max(-(-count // records_per_task), 0))
        self.records = sum(max(c, 0) for _, _, c in self.shards)

    def __len__(self) -> int:
        return self._cum[-1]

    def piece(self, i: int) -> tuple[str, int, int]:
        k = bisect_right(self._cum, i) - 1
        name, start, count = self.shards[k]
        a = start + (i - self._cum[k]) * self.records_per_task
        return name, a, min(a + self.records_per_task, start + count)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self.piece(k) for k in range(*i.indices(len(self)))]
        return self.piece(i)

    def __iter__(self) -> Iterator[tuple[str, int, int]]:
        return (self.piece(i) for i in range(len(self)))

    def to_json(self) -> dict[str, Any]:
        return {"shards": [list(s) for s in self.shards], "rpt": self.records_per_task}

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> PieceSource:
        return cls(v["shards"], int(v["rpt"]))


Explicit = list[tuple[str, int, int, int]]   # (name, start, end, epoch) per position


@dataclass
class Block:
    """Ids ``[base, base + count)``: position ``p`` is piece ``perm(p)`` of
    ``source`` (a name of the task manager's sources, or explicit pieces).
    ``next``: the first position not handed out yet; ``records_out``: records of
    the positions before it."""

    base: int
    count: int
    type: TaskType
    source: Union[str, Explicit]
    epoch: int = 0
    model_version: int = -1
    seed: Optional[int] = None
    next: int = 0
    records_out: int = 0
    _perm: Optional[Permutation] = field(default=None, repr=False, compare=False)

    @property
    def left(self) -> int:
        return self.count - self.next

    def contains(self, task_id: int) -> bool:
        return self.base <= task_id < self.base + self.count

    def index(self, p: int) -> int:
        if self.seed is None:
            return p
        if self._perm is None:
            self._perm = Permutation(self.count, self.seed)
        return self._perm(p)

    def task(self, p: int, sources: Mapping[str, Sequence[tuple[str, int, int]]]) -> Task:
        """The task at position ``p`` (``sources``: name -> indexable pieces)."""
        i = self.index(p)
        if isinstance(self.source, str):
            name, start, end = sources[self.source][i]
            epoch = self.epoch
        else:
            name, start, end, epoch = self.source[i]
        return Task(self.base + p, self.type, name, start, end, epoch, self.model_version)

    def trim(self) -> None:
        """Drop explicit pieces already handed out (their ids stay the same: the
        base moves up with them), so a resumed run's pending ranges shrink as
        they go out."""
        if isinstance(self.source, list) and self.seed is None and self.next:
            del self.source[:self.next]
            self.base += self.next
            self.count -= self.next
            self.next = self.records_out = 0

    def to_json(self) -> list[Any]:
        if isinstance(self.source, str):
            src: Any = self.source
            base, count, nxt, out = self.base, self.count, self.next, self.records_out
        else:   # explicit pieces: only those not handed out yet
            src = [list(p) for p in self.source[self.next:]]
            base, count, nxt, out = self.base + self.next, self.count - self.next, 0, 0
        return [base, count, int(self.type), src, self.epoch, self.model_version,
                self.seed, nxt, out]

    @classmethod
    def from_json(cls, v: Sequence[Any]) -> Block:
        src = v[3] if isinstance(v[3], str) else [
            (str(n), int(a), int(b), int(e)) for n, a, b, e in v[3]]
        return cls(int(v[0]), int(v[1]), TaskType(int(v[2])), src, int(v[4]), int(v[5]),
                   None if v[6] is None else int(v[6]), int(v[7]), int(v[8]))


def gaps(closed: Any, lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """The sub-ranges of ``[lo, hi)`` not in the IntervalSet ``closed`` (O(its
    intervals that overlap))."""
    pos = lo
    for a, b in closed:
        if b <= pos:
            continue
        if a >= hi:
            break
        if a > pos:
            yield pos, a
        pos = max(pos, b)
        if pos >= hi:
            return
    if pos < hi:
        yield pos, hi
