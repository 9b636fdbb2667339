"""The elastic dataset fed by master tasks, and the ``ctx`` of a custom ``train_loop``
(:class:`ElasticLoopContext`, the worker's :class:`~elasticdl.api.train_loop.TrainLoopContext`).

A model module's ``train_loop(ctx)`` (the example is in :mod:`elasticdl.api.train_loop`)
runs here, for AllreduceStrategy.

The step function must be declared (``ctx.step``) before iterating
``ctx.dataset``: a member without data runs it on a filler batch with weight 0
(``ctx.is_filler`` is True then) while others train. ``retain_grad()`` and
tensor hooks work inside it as usual; ``ctx.all_gather`` / ``ctx.all_reduce``
keep autograd on the current group. Collectives belong *inside* the step
function: it is the only user code every member runs in every step (a member
waiting for data does not run the loop body), and a failure inside it is
retried on the re-formed group. The step may run more than once for a batch
(retries); keep counts that must survive membership changes in ``ctx.counters``.

Between steps a member runs whatever the master hands it (an evaluation task, a
``get_task`` call); the others wait for it in the next step's collectives, so
such work must take less than ``--collective_timeout_s``.

Records accounting: a task is reported done only when the steps of all its
minibatches are confirmed on every member (the next round's header), so the
master's ``records_completed`` counts each record once whatever happens to the
membership; tasks of a worker that died are re-queued by the master. Every
member knows which minibatches of every member are in the model
(:mod:`elasticdl.elastic.trained`), so the next holder of a re-queued task
skips those the dead worker had stepped: each record is trained once.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from elasticdl.api.train_loop import TrainLoopContext
from elasticdl.common import collective
from elasticdl.common.intervals import IntervalSet
from elasticdl.common.task import Task, TaskType
from elasticdl.data.api import DataError
from elasticdl.data.prefetch import Prefetcher
from elasticdl.elastic.runner import ElasticRunner, ElasticState, RoundStatus
from elasticdl.worker.minibatches import Minibatch, TaskRecords
from elasticdl.worker.poller import TaskPoller, minibatch_count, minibatch_slice
from elasticdl.worker.task_source import TaskSource

logger = logging.getLogger(__name__)

Feed = Callable[[Sequence[Any], Task, int], tuple[Any, Any]]


@dataclass(eq=False)
class _TaskState:
    task: Task
    records: Any                 # a Sequence of records, or a TaskRecords
    num_batches: int
    cursor: int = 0
    confirmed: set[int] = field(default_factory=set)
    loss_sum: Any = 0.0          # of this member's steps of the task, weighted by records
                                 # (a tensor: no device sync per step)
    loss_records: int = 0
    last_lr: Optional[float] = None   # the lr the task's last step was applied with
    ahead: Optional[Prefetcher[Minibatch]] = None   # TaskRecords: minibatches made ahead
    peek: Optional[Minibatch] = None

    @property
    def num_records(self) -> int:
        if isinstance(self.records, TaskRecords):
            return self.records.num_records
        return len(self.records)

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None
        self.peek = None


@dataclass(frozen=True)
class BatchTag:
    """Which records a microbatch holds (the tag the runner hands back)."""

    state: _TaskState
    index: int
    records: int

    @property
    def epoch(self) -> int:
        """The master's epoch of the minibatch's task."""
        return int(self.state.task.epoch)

    @property
    def lr_reductions(self) -> int:
        """The metric-driven LR reductions the master decided when the task went out."""
        return int(getattr(self.state.task, "lr_reductions", 0))


def batch_records(args: Sequence[Any]) -> int:
    """Records in a batch passed as step arguments: the first dimension of the
    first tensor found (labels or features)."""
    for a in reversed(args):
        ref = a
        while isinstance(ref, (dict, list, tuple)) and ref:
            ref = next(iter(ref.values())) if isinstance(ref, dict) else ref[0]
        if isinstance(ref, torch.Tensor) and ref.dim() > 0:
            return int(ref.shape[0])
    raise ValueError("cannot tell the number of records of this batch; pass tensors")


class ElasticDataset:
    """Minibatches of the master's training tasks for an elastic runner.

    Args:
        runner: the worker's elastic runner (its ``on_confirmed``/``on_lost``
            are taken over).
        source: the master (``get_task``/``report_task``).
        read: records of a task: a sequence (cut into minibatches and passed to
            ``feed``), or a :class:`~elasticdl.worker.minibatches.TaskRecords`, whose
            minibatches are made ahead in a background thread while steps run.
        feed: ``feed(records, task, offset) -> (features, labels)`` for a
            minibatch starting ``offset`` records into the task (sequences only).
        on_data_error: called as ``cb(task, error)`` when making a minibatch of a
            TaskRecords raised a DataError (before it propagates).
        minibatch_size: records per minibatch.
        run_other_task: runs and reports an evaluation or prediction task.
        wait_s / max_wait_s: pause after an idle round, and the longest wait.
    """

    def __init__(self, runner: ElasticRunner, source: TaskSource,
                 read: Callable[[Task], Any], feed: Feed, minibatch_size: int,
                 run_other_task: Optional[Callable[[Task], None]] = None,
                 wait_s: float = 0.2, max_wait_s: float = 3600.0,
                 on_data_error: Optional[Callable[[Task, DataError], None]] = None):
        self.runner = runner
        self.source = source
        self.read = read
        self.feed = feed
        self.minibatch_size = minibatch_size
        self.run_other_task = run_other_task
        self.wait_s = wait_s
        self.max_wait_s = max_wait_s
        self.on_data_error = on_data_error
        self.task: Optional[Task] = None
        self.tasks_reported = 0
        self.records_trained = 0
        self._queue: deque[_TaskState] = deque()
        self._redo: deque[BatchTag] = deque()
        self._current: Optional[BatchTag] = None
        runner.on_confirmed = self._confirmed
        runner.on_lost = self._lost

    @property
    def epoch(self) -> int:
        return self.task.epoch if self.task is not None else 0

    def take_current(self) -> Optional[BatchTag]:
        """The batch last yielded, now consumed by a step (None if already taken)."""
        tag, self._current = self._current, None
        return tag

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        poller = TaskPoller(self.source, self.wait_s, self.max_wait_s)
        group_done = False

        def idle_round() -> bool:  # while the master says WAIT: join the group's rounds
            nonlocal group_done
            status = self.runner.flush().status
            group_done = status == RoundStatus.DONE
            return status == RoundStatus.IDLE  # pause only when nothing happened

        while True:
            self._skip_unstepped()
            tag = self._next_tag()
            if tag is not None:
                features, labels = self._make(tag)
                self._current = tag
                yield features, labels
                continue
            task = poller.poll(while_waiting=idle_round)
            if task.type == TaskType.TRAINING:
                records = self.read(task)
                n = records.num_minibatches if isinstance(records, TaskRecords) else \
                    minibatch_count(len(records), self.minibatch_size)
                self._queue.append(self._task_state(task, records, n))
                if len(self._queue[-1].confirmed) == n:
                    self._report(self._queue.pop())
                continue
            if task.type in (TaskType.EVALUATION, TaskType.PREDICTION,
                             TaskType.EVALUATION_FINALIZE):
                if self.run_other_task is None:
                    raise RuntimeError(f"no handler for {task.type.name} task {task.task_id}")
                self.run_other_task(task)
                continue
            if task.type == TaskType.WAIT:
                if group_done:
                    self._stopped()
                    return
                continue
            # NONE: the master has nothing left for anyone
            if self.runner.pending:
                self.runner.flush()
            self.runner.leave_round()
            self._stopped()
            return

    # ------------------------------------------------------------ internals
    def _task_state(self, task: Task, records: Sequence[Any], n: int) -> _TaskState:
        """A new task; its minibatches already in the model (a task re-queued after
        its holder died mid-task, whose steps the group applied) are skipped."""
        state = _TaskState(task, records, n)
        trained = self.runner.trained
        if trained is not None and task.closed is not None:  # the master's closed tasks
            trained.settle(task.closed[0], IntervalSet.from_flat(task.closed[1]))
        if trained is not None and n:
            state.confirmed = trained.minibatches_of(task.task_id, n)
            if state.confirmed:
                logger.info("task %d resumes: minibatch(es) %s of %d already in the model "
                            "(stepped by an earlier holder); skipped", task.task_id,
                            sorted(state.confirmed), n)
        if isinstance(records, TaskRecords) and len(state.confirmed) < n:
            state.ahead = records.produce(skip=frozenset(state.confirmed))
        return state

    def _next_tag(self) -> Optional[BatchTag]:
        if self._redo:
            tag = self._redo.popleft()
            self.task = tag.state.task
            return tag
        for state in self._queue:
            while state.cursor < state.num_batches and state.cursor in state.confirmed:
                state.cursor += 1   # skipped: already in the model
            if state.cursor < state.num_batches:
                i = state.cursor
                state.cursor += 1
                s = minibatch_slice(i, state.num_records, self.minibatch_size)
                self.task = state.task
                return BatchTag(state, i, s.stop - s.start)
        return None

    def _make(self, tag: BatchTag) -> tuple[Any, Any]:
        state = tag.state
        if not isinstance(state.records, TaskRecords):
            s = minibatch_slice(tag.index, len(state.records), self.minibatch_size)
            return self.feed(state.records[s], state.task, s.start)
        try:
            mb = self._take(state, tag.index)
        except DataError as e:
            state.close()
            if self.on_data_error is not None:
                self.on_data_error(state.task, e)
            raise
        return mb.features, mb.labels

    @staticmethod
    def _take(state: _TaskState, index: int) -> Minibatch:
        """Minibatch ``index`` of the task: the one made ahead when it is next in line,
        else made now (a minibatch trained again after a membership change)."""
        while state.ahead is not None:
            mb = state.peek if state.peek is not None else next(state.ahead, None)
            state.peek = None
            if mb is None:
                state.close()
                break
            if mb.index == index:
                return mb
            if mb.index > index:
                state.peek = mb
                break
            # made ahead but no longer wanted: dropped
        assert isinstance(state.records, TaskRecords)
        return state.records.make(index)

    def _skip_unstepped(self) -> None:
        tag = self.take_current()
        if tag is not None:  # the loop did not train it: the user skipped it
            logger.debug("minibatch %d of task %d skipped by the loop", tag.index,
                         tag.state.task.task_id)
            self._confirmed([tag])

    def _confirmed(self, tags: list[Any]) -> None:
        for tag in tags:
            if not isinstance(tag, BatchTag):
                continue
            state = tag.state
            state.confirmed.add(tag.index)
            self.records_trained += tag.records
            if len(state.confirmed) == state.num_batches and state in self._queue:
                self._queue.remove(state)
                state.close()
                self._report(state)

    def record_step(self, tags: Sequence[Any], outputs: Sequence[Any],
                    lr: Optional[float]) -> None:
        """A step this member took part in applied ``tags`` (its own microbatches)
        with ``outputs`` (the step function's results, one per tag) at learning rate
        ``lr``: kept for the tasks' reports (mean loss, last learning rate). An
        output counts as a loss when it is a scalar tensor or number, or a dict with
        a ``"loss"`` entry."""
        for tag, out in zip(tags, outputs):
            if not isinstance(tag, BatchTag):
                continue
            tag.state.last_lr = lr
            loss = _loss_of(out)
            if loss is not None:
                tag.state.loss_sum += loss * tag.records
                tag.state.loss_records += tag.records

    def _report(self, state: _TaskState) -> None:
        loss = float(state.loss_sum) / state.loss_records if state.loss_records else None
        self.source.report_task(state.task, loss=loss, learning_rate=state.last_lr)
        self.tasks_reported += 1
        logger.debug("task %d done (%d records)", state.task.task_id, state.num_records)

    def _lost(self, tags: list[Any]) -> None:
        for tag in tags:
            if isinstance(tag, BatchTag):
                self._redo.append(tag)

    def _stopped(self) -> None:
        left = [s.task.task_id for s in self._queue] + [t.state.task.task_id for t in self._redo]
        if left or self.runner.pending:
            logger.error("training stopped with unfinished task(s) %s; reported as failed "
                         "so the master re-queues them", sorted(set(left)))
            for state in self._queue:
                state.close()
                self.source.report_task(state.task, "training group stopped before the task "
                                        "finished")
            self._queue.clear()
            self._redo.clear()


def _loss_of(out: Any) -> Any:
    if isinstance(out, dict):
        out = out.get("loss")
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out.detach().float().reshape(())
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        return float(out)
    return None


class ElasticLoopContext(TrainLoopContext):
    """What a model module's ``train_loop(ctx)`` receives (see module docs): the
    :class:`~elasticdl.api.train_loop.TrainLoopContext` of an elastic runner."""

    dataset: ElasticDataset

    def __init__(self, runner: ElasticRunner, dataset: ElasticDataset,
                 device: torch.device, lr_scheduler: Optional[Any] = None,
                 amp: str = "off"):
        self.runner = runner
        self.dataset = dataset
        self.device = device
        self._lr_scheduler = lr_scheduler
        self.amp = amp

    @property
    def lr_scheduler(self) -> Optional[Any]:
        """The module's ``lr_scheduler``, stepped by the framework (every member
        alike: per epoch of the master, or after every global update); None when
        the module defines none. A loop may make its own scheduler instead and step
        it inside the step function (which every member runs every step)."""
        return self._lr_scheduler

    def autocast(self) -> Any:
        """``torch.autocast`` for ``--amp=bf16`` (a no-op context when off)."""
        from elasticdl.worker.trainer import autocast

        return autocast(self.amp, self.device)

    @property
    def step_epoch(self) -> int:
        """The agreed epoch of the current step, once its gradients are reduced
        (after ``backward()``): the same on every member, filler ones included."""
        return self.runner.step_epoch

    @property
    def state(self) -> ElasticState:
        return self.runner.state

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.state.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.runner.state.optimizer

    @property
    def counters(self) -> dict[str, Any]:
        return self.runner.state.counters

    @property
    def rank(self) -> int:
        return self.runner.group.rank

    @property
    def world_size(self) -> int:
        return self.runner.group.world_size

    @property
    def model_version(self) -> int:
        return self.runner.state.model_version

    @property
    def epoch(self) -> int:
        """The master's epoch of the minibatch ``ctx.dataset`` yielded last."""
        return self.dataset.epoch

    @property
    def is_filler(self) -> bool:
        """True while the step function runs on a filler batch (weight 0): skip logging."""
        return self.runner.is_filler

    def step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Make ``fn`` (one training step on one minibatch: zero_grad, forward,
        backward, optimizer step) elastic; usable as a decorator.

        The wrapper returns ``fn``'s result once the step ran, None while
        accumulating microbatches or when the step took effect on another member
        before a failure.
        """
        self.runner.step_fn = fn

        @functools.wraps(fn)
        def elastic_step(*args: Any) -> Any:
            tag = self.dataset.take_current()
            records = tag.records if tag is not None else batch_records(args)
            result = self.runner.submit(fn, args, records, tag)
            if result is None or not result.outputs:
                return None
            return result.outputs[-1]

        return elastic_step

    def all_gather(self, tensor: torch.Tensor, local_grad: bool = False) -> list[torch.Tensor]:
        return collective.all_gather(tensor, local_grad=local_grad)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return collective.all_reduce(tensor, op=op)
