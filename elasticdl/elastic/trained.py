"""Which records the group's model was trained on, agreed by every member.

An allreduce checkpoint must record its data position (see
:mod:`elasticdl.checkpoint.data_position`): the minibatches of every member
whose steps are in the model. Each member keeps the minibatches it stepped
since the last checkpoint; at a checkpoint step every member contributes them
in two all-gathers (counts, then entries), so each ends up with the same union (completing
the gather proves every member applied that step). The union is part of the
elastic state, broadcast to members that join and saved with the checkpoint.

Minibatches handed back as *lost* (a member had to re-join and its
unconfirmed steps are not in the model) are dropped before they are gathered;
they are always newer than the last gather, since a completed gather confirms
every step before it.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from elasticdl.elastic import collective
from elasticdl.elastic.collective import guard

logger = logging.getLogger(__name__)

Entry = tuple[int, int, int]   # task id, offset of the minibatch in the task, records


class TrainedRecords:
    """The group's agreed data position (``register``-ed into the elastic state).

    Args:
        minibatch_size: records per minibatch (a tag's index -> offset).
    """

    def __init__(self, minibatch_size: int):
        self.minibatch_size = minibatch_size
        self.agreed: dict[tuple[int, int], int] = {}   # (task, offset) -> records
        self.last_saved = 0            # model version of the last checkpoint (agreed)
        # own minibatches stepped since the last gather: (task, offset) -> records
        self._mine: dict[tuple[int, int], int] = {}

    # ------------------------------------------------------------- own steps
    def _key(self, tag: Any) -> Optional[tuple[int, int]]:
        if not (hasattr(tag, "state") and hasattr(tag, "index")):
            return None   # a filler step or a batch that is not a master task's
        return int(tag.state.task.task_id), int(tag.index) * self.minibatch_size

    def stepped(self, tags: list[Any]) -> None:
        """Tags (elastic dataset ``BatchTag``) of this member's microbatches in a step."""
        for tag in tags:
            key = self._key(tag)
            if key is not None:
                self._mine[key] = int(tag.records)

    def lost(self, tags: list[Any]) -> None:
        """Tags whose steps are not in the model any more (trained again later)."""
        for tag in tags:
            key = self._key(tag)
            if key is not None:
                self._mine.pop(key, None)

    def _own_entries(self) -> list[Entry]:
        return [(t, o, r) for (t, o), r in self._mine.items()]

    # ------------------------------------------------------------- agreement
    def gather(self, version: int, world_size: int,
               device: Optional[torch.device] = None) -> None:
        """Add every member's own minibatches to the agreed set (a collective every
        member calls at the same step). Asynchronous collectives waited on with
        :func:`collective.wait`, so a member's death aborts it as fast as a step's.

        Raises:
            CollectiveError: the gather failed; nothing changed.
        """
        device = device or torch.device("cpu")
        mine = torch.tensor(self._own_entries(), dtype=torch.int64,
                            device=device).reshape(-1, 3)
        counts = self._all_gather(torch.tensor([mine.shape[0]], dtype=torch.int64,
                                                device=device), world_size, "counts")
        longest = max(int(c.item()) for c in counts)
        padded = torch.zeros((longest, 3), dtype=torch.int64, device=device)
        padded[:mine.shape[0]] = mine
        parts = self._all_gather(padded, world_size, "entries")
        for count, part in zip(counts, parts):
            for task, offset, records in part[:int(count.item())].cpu().tolist():
                self.agreed[(task, offset)] = records
        self._mine = {}
        self.last_saved = version

    @staticmethod
    def _all_gather(t: torch.Tensor, world_size: int, what: str) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(world_size)]
        op = f"all_gather (trained records: {what})"
        with guard(op):
            work = dist.all_gather(out, t, async_op=True)
        try:
            collective.wait(work, op)
        except BaseException:
            collective.defer_dispose([work])   # disposed after the group, as step work
            raise
        return out

    def entries(self) -> list[Entry]:
        return [(t, o, r) for (t, o), r in sorted(self.agreed.items())]

    # ------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {"entries": [list(e) for e in self.entries()], "last_saved": self.last_saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.agreed = {(int(t), int(o)): int(r) for t, o, r in state.get("entries", [])}
        self.last_saved = int(state.get("last_saved", 0))
