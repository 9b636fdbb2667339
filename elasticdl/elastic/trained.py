"""Which minibatches are in the group's model: every member's, known to every member.

Each step's meta all-reduce (:mod:`elasticdl.elastic.grad_sync`) carries the
identities of the step's microbatches — ``(task id, minibatch index,
records)``, the task id in two halves — in a small ``[world_size, k, 4]``
block every member fills its own row of, so the sum is the gather (no extra
collective). When the step takes
effect on a member (the optimizer stepped, the model version advanced), the
member adds the whole block to its :class:`TrainedRecords`. So on every member
the set is exactly what its own model was trained on — its own minibatches and
those of every other member, including one that died afterwards — and, being
part of the elastic state, it travels with the model: the most advanced
survivor's model and set are broadcast together after a membership change
(also to joining and relaunched members).

Uses: a member that receives a training task skips the minibatches of it that
are already in the model (a task re-queued after its holder died mid-task, see
:class:`elasticdl.worker.elastic_dataset.ElasticDataset`), so each record is trained
once; a member that had to re-join keeps the steps the adopted model holds
instead of training them again; a checkpoint records the set as its data
position (:mod:`elasticdl.checkpoint.data_position`).

Sized by the live state (docs/scale.md): training tasks the master counted
done (``closed``, an :class:`~elasticdl.common.intervals.IntervalSet`, with the
master's rollback version as its ``generation``) arrive with the tasks the
master hands out (:meth:`TrainedRecords.settle`); their entries are dropped
and they count as wholly in the model. The set, what a joiner receives and
what a checkpoint records stay O(tasks not closed). Members may learn a new
closed set at different times: a task in ``closed`` or in the entries is in
the model either way, so their answers agree.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

from elasticdl.common.intervals import IntervalSet

logger = logging.getLogger(__name__)

Entry = tuple[int, int, int]   # task id, offset of the minibatch in the task, records
Identity = tuple[int, int, int]   # task id, minibatch index, records (what a step exchanges)


def identity_of(tag: Any) -> Optional[Identity]:
    """A microbatch's identity from its tag (elastic dataset ``BatchTag``); None for
    a filler step or a batch that is not a master task's."""
    if not (hasattr(tag, "state") and hasattr(tag, "index") and hasattr(tag, "records")):
        return None
    return int(tag.state.task.task_id), int(tag.index), int(tag.records)


class TrainedRecords:
    """The minibatches in the model (``register``-ed into the elastic state).

    Args:
        minibatch_size: records per minibatch (a minibatch index -> offset).
    """

    # numbers per identity in a step's (float64) meta block: the task id in two 32-bit
    # halves (ids of a run start at a large base; float64 is exact only below 2**53),
    # the minibatch index, the records (0: an empty slot)
    FIELDS = 4

    def __init__(self, minibatch_size: int):
        self.minibatch_size = minibatch_size
        self.agreed: dict[tuple[int, int], int] = {}   # (task, offset) -> records
        self.last_saved = 0            # model version of the last checkpoint (agreed)
        self.closed = IntervalSet()    # tasks the master counted done: wholly in the model
        self.generation = -1           # the master's rollback version of ``closed``
        self._by_task: dict[int, set[int]] = {}   # task -> offsets in ``agreed``

    # ----------------------------------------------------- per-step exchange
    def encode(self, tags: Sequence[Any], rank: int, world_size: int,
               slots: int) -> list[float]:
        """This member's block of a step's meta: ``world_size * slots`` identities,
        zeros but for this member's row (its microbatches' identities)."""
        if len(tags) > slots:
            raise RuntimeError(f"{len(tags)} microbatches in a step with room for {slots}")
        block = [0.0] * (world_size * slots * self.FIELDS)
        at = rank * slots * self.FIELDS
        for tag in tags:
            ident = identity_of(tag)
            if ident is not None:
                task, index, records = ident
                block[at:at + self.FIELDS] = [float(task >> 32), float(task & 0xFFFFFFFF),
                                              float(index), float(records)]
            at += self.FIELDS
        return block

    def record(self, block: Sequence[float]) -> int:
        """Add the identities of a summed meta block (a step that took effect);
        returns how many were added."""
        added = 0
        for i in range(0, len(block) - self.FIELDS + 1, self.FIELDS):
            high, low, index, records = (int(round(v)) for v in block[i:i + self.FIELDS])
            task = (high << 32) + low
            if records > 0 and task not in self.closed:
                offset = index * self.minibatch_size
                self.agreed[(task, offset)] = records
                self._by_task.setdefault(task, set()).add(offset)
                added += 1
        return added

    def settle(self, generation: int, closed: IntervalSet) -> Optional[int]:
        """The master's closed tasks: drop their entries; returns how many were
        dropped, or None for a set older than the one held (ignored)."""
        if generation < self.generation:
            return None
        self.generation = generation
        self.closed = self.closed.union(closed)
        dropped = 0
        for task in [t for t in self._by_task if t in self.closed]:
            for offset in self._by_task.pop(task):
                del self.agreed[(task, offset)]
                dropped += 1
        return dropped

    # ------------------------------------------------------------- queries
    def holds(self, tag: Any) -> bool:
        """Whether the minibatch of ``tag`` is in the model."""
        ident = identity_of(tag)
        return ident is not None and (ident[0] in self.closed or
                                      (ident[0], ident[1] * self.minibatch_size) in self.agreed)

    def minibatches_of(self, task_id: int, num_batches: int) -> set[int]:
        """Indexes of the minibatches of task ``task_id`` in the model."""
        if task_id in self.closed:
            return set(range(num_batches))
        mbs = self.minibatch_size
        return {i for i in range(num_batches) if (task_id, i * mbs) in self.agreed}

    def entries(self) -> list[Entry]:
        """Entries of tasks not closed (O(live))."""
        return [(t, o, r) for (t, o), r in sorted(self.agreed.items())]

    # ------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {"entries": [list(e) for e in self.entries()], "last_saved": self.last_saved,
                "closed": self.closed.to_flat(), "generation": self.generation}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.closed = IntervalSet.from_flat([int(x) for x in state.get("closed", [])])
        self.generation = int(state.get("generation", -1))
        self.agreed = {}
        self._by_task = {}
        for t, o, r in state.get("entries", []):
            if int(t) not in self.closed:
                self.agreed[(int(t), int(o))] = int(r)
                self._by_task.setdefault(int(t), set()).add(int(o))
        self.last_saved = int(state.get("last_saved", 0))
