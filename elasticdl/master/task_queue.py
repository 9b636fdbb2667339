"""The task manager's queues: blocks of ids handed out position by position,
and tasks re-queued ahead of them (a mixin of :class:`TaskManager`; see
:mod:`task_blocks`). No torch."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Optional

from elasticdl.common.intervals import IntervalSet
from elasticdl.common.task import Task, TaskType
from elasticdl.common.task_blocks import Block
from elasticdl.master.task_state import EVAL_TYPES, Doing


class TaskQueues:
    """Queue state and dispatch order of :class:`TaskManager`."""

    _lock: threading.RLock
    _next_id: int
    _blocks: list[Block]
    _requeued: deque[Task]
    _eval_requeued: deque[Task]
    _doing: dict[int, Doing]
    _train_pieces: Sequence[tuple[str, int, int]]
    _eval_pieces: Sequence[tuple[str, int, int]]
    _predict_pieces: Sequence[tuple[str, int, int]]
    _epochs_created: int
    num_epochs: int
    training_records: int
    hold_training: bool
    epoch_barrier: bool
    completed: IntervalSet
    block_created_callbacks: list[Callable[[Block], None]]

    def _create_epoch(self) -> None:
        raise NotImplementedError

    def _epoch_open(self) -> bool:
        raise NotImplementedError

    @property
    def sources(self) -> dict[str, Sequence[tuple[str, int, int]]]:
        return {"train": self._train_pieces, "eval": self._eval_pieces,
                "predict": self._predict_pieces}

    def _new_block(self, count: int, typ: TaskType, source: Any, epoch: int = 0,
                   model_version: int = -1, seed: Optional[int] = None) -> Block:
        block = Block(self._next_id, count, typ, source, epoch, model_version, seed)
        self._next_id += count
        self._blocks.append(block)
        for cb in self.block_created_callbacks:
            cb(block)
        return block

    def _fresh(self, evaluation: bool, types: Optional[tuple[TaskType, ...]] = None
               ) -> Optional[Block]:
        """The first block (in id order) of that family with positions left."""
        for block in self._blocks:
            if (block.type in EVAL_TYPES) == evaluation and (types is None or
                                                             block.type in types):
                return block
        return None

    def _take(self, block: Block) -> Task:
        task = block.task(block.next, self.sources)
        block.next += 1
        block.records_out += task.num_records
        if block.left == 0:
            self._blocks.remove(block)
        elif block.next >= 4096 and block.seed is None:
            block.trim()   # explicit pieces (a resumed run's): memory O(pieces left)
        return task

    def _has_todo(self) -> bool:
        return bool(self._requeued) or self._fresh(False) is not None

    def _pop(self, task_type: Optional[TaskType]) -> Optional[Task]:
        while True:
            task = None
            eval_block = self._fresh(True)
            if (self._eval_requeued or eval_block) and task_type in (None, TaskType.EVALUATION):
                task = self._eval_requeued.popleft() if self._eval_requeued else \
                    self._take(eval_block)  # type: ignore[arg-type]
            elif task_type != TaskType.EVALUATION:
                if not self._has_todo() and self._epochs_created < self.num_epochs and \
                        len(self._train_pieces) and not self.hold_training and \
                        not (self.epoch_barrier and self._epoch_open()):
                    self._create_epoch()
                task = self._pop_todo()
            # a reassigned straggler's task may have been finished by its first holder
            if task is None or task.task_id not in self.completed:
                return task

    def _pop_todo(self) -> Optional[Task]:
        """The first queued task that may go out now: while ``hold_training`` only
        prediction tasks and a timed-out straggler's training task (the barrier
        waits for that work, not for the hung holder)."""
        if not self.hold_training:
            if self._requeued:
                return self._requeued.popleft()
            block = self._fresh(False)
            return self._take(block) if block is not None else None
        for i, task in enumerate(self._requeued):
            if task.type != TaskType.TRAINING or task.task_id in self._doing:
                del self._requeued[i]
                return task
        block = self._fresh(False, (TaskType.PREDICTION,))
        return self._take(block) if block is not None else None

    def queued(self) -> dict[TaskType, int]:
        """Tasks queued (re-queued or not handed out yet) per type."""
        with self._lock:
            out: dict[TaskType, int] = {}
            for task in list(self._requeued) + list(self._eval_requeued):
                out[task.type] = out.get(task.type, 0) + 1
            for block in self._blocks:
                out[block.type] = out.get(block.type, 0) + block.left
            return out

    def training_records_left(self) -> int:
        """Training records not yet done: queued or held tasks plus epochs to come."""
        with self._lock:
            held = [d.task for d in self._doing.values()] + list(self._requeued)
            queued = sum(t.num_records for t in held if t.type == TaskType.TRAINING)
            for block in self._blocks:
                if block.type == TaskType.TRAINING:
                    total = self.training_records if isinstance(block.source, str) else \
                        sum(b - a for _, a, b, _ in block.source)
                    queued += total - block.records_out
            future = self.num_epochs - self._epochs_created if len(self._train_pieces) else 0
            return queued + self.training_records * future

