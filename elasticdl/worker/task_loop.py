"""The worker's task loop, shared by every strategy.

``get task -> read records -> feed minibatches -> train / evaluate / predict ->
report``. A task counts only once it is reported done. Bad data fails the task
as *fatal* (retrying cannot help) with the file and record named; any other
error is reported with its traceback and re-raised, so the process exits
non-zero and the master's relaunch policy decides what happens next.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from elasticdl.api.model_spec import ModelSpec
from elasticdl.common.task import Task, TaskType
from elasticdl.data.api import DataError, DataReader
from elasticdl.data.torch_dataset import TorchDatasetReader
from elasticdl.worker.eval_metrics import EvalMetrics
from elasticdl.worker.minibatches import (  # noqa: F401 - FeedError, feed_records re-exported
    FeedError,
    Minibatch,
    TaskRecords,
    feed_records,
)
from elasticdl.worker.nested import to_device
from elasticdl.worker.poller import DEFAULT_MAX_WAIT_S, LeasedTasks, TaskPoller
from elasticdl.worker.prediction import PredictionSink
from elasticdl.worker.read_ahead import ReadAhead
from elasticdl.worker.task_source import Metric, TaskSource
from elasticdl.worker.trainer import NonFiniteError, Trainer, batch_size_of

logger = logging.getLogger(__name__)

MODES = {TaskType.TRAINING: "training", TaskType.EVALUATION: "evaluation",
         TaskType.PREDICTION: "prediction", TaskType.EVALUATION_FINALIZE: "evaluation"}

StepCallback = Callable[[Task, int, torch.Tensor], None]


@dataclass
class LoopStats:
    tasks: int = 0
    train_records: int = 0
    eval_records: int = 0
    predict_records: int = 0
    steps: int = 0
    nonfinite_skipped: int = 0


class TaskLoop:
    """Drives a :class:`Trainer` with tasks from a :class:`TaskSource`.

    Args:
        readers: the reader for each task type's dataset.
        after_train_step: called as ``cb(task, records_done_in_task, loss)``
            after every training minibatch (progress, checkpoints, evaluation
            triggers).
        wait_s / max_wait_s: polling interval while the master says WAIT, and
            how long in total a worker may be told to wait before giving up.
        eval_minibatch_size: records per minibatch of evaluation and prediction
            tasks (0: ``minibatch_size``).
        lease_s: with a source that leases (the master), ask for about this many
            seconds of tasks per call and send results with the next call
            (:class:`LeasedTasks`, ``--task_lease_s``); 0: one task per call, each
            result at once.
        read_ahead: with a leasing source, read the next leased task's records while
            the current one runs (:mod:`elasticdl.worker.read_ahead`,
            ``--task_read_ahead``).
    """

    def __init__(self, source: TaskSource, trainer: Trainer, spec: ModelSpec,
                 readers: dict[TaskType, DataReader], minibatch_size: int,
                 worker_id: int = 0, prediction_sink: Optional[PredictionSink] = None,
                 after_train_step: Sequence[StepCallback] = (),
                 after_task: Sequence[Callable[[Task], None]] = (),
                 wait_s: float = 0.2, max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 skip_nonfinite_steps: bool = False, eval_minibatch_size: int = 0,
                 lease_s: float = 0.0, read_ahead: bool = True):
        self.source = source
        self._reporter: TaskSource = source   # where run_task reports (the lease buffer)
        self.lease_s = lease_s
        self.read_ahead = read_ahead
        self.trainer = trainer
        self.spec = spec
        self.readers = readers
        self.minibatch_size = minibatch_size
        self.eval_minibatch_size = eval_minibatch_size or minibatch_size
        self.worker_id = worker_id
        self.prediction_sink = prediction_sink
        self.after_train_step = list(after_train_step)
        self.after_task = list(after_task)
        self.wait_s = wait_s
        self.max_wait_s = max_wait_s
        self.skip_nonfinite_steps = skip_nonfinite_steps
        self.stats = LoopStats()
        self._skipped_in_task = self._records_skipped = 0   # in the current task
        self._loss_sum: Any = 0.0                             # of the current task
        self._loss_records = 0
        self._metrics = EvalMetrics(spec.metrics(), getattr(trainer, "device", "cpu"))
        self._ahead: Optional[ReadAhead] = None   # while run() runs on a leasing source
        self._leased: Optional[LeasedTasks] = None

    def run(self) -> LoopStats:
        """Run tasks until the source has none left.

        Raises:
            TimeoutError: told to wait for ``max_wait_s`` in a row.
            DataError / Exception: a task failed (reported first, see the module).
        """
        source: TaskSource = self.source
        leased = None
        if self.lease_s > 0 and LeasedTasks.supported(source):
            source = leased = LeasedTasks(source, self.lease_s)
        poller = TaskPoller(source, self.wait_s, self.max_wait_s)
        self._reporter = source
        self._leased = leased
        self._ahead = ReadAhead(self._read_records) \
            if leased is not None and self.read_ahead else None
        try:
            while True:
                task = poller.next_task()
                if task.type == TaskType.NONE:
                    return self.stats
                if self.stats.tasks == 0:
                    logger.info("worker %d: first task %d (%s, records %d-%d of %s)",
                                self.worker_id, task.task_id, MODES.get(task.type, task.type),
                                task.start, task.end, task.shard_name)
                self.run_task(task)
        except BaseException:
            if leased is not None:  # results of the tasks done, before the worker ends
                try:
                    leased.flush()
                except Exception as e:  # noqa: BLE001 - the error being raised comes first
                    logger.warning("could not send the waiting task results: %s", e)
            raise
        finally:
            self._reporter = self.source
            if self._ahead is not None:
                self._ahead.close()
                if self._ahead.hits or self._ahead.dropped:
                    logger.info("worker %d: %d task(s) read ahead, %d read ahead and dropped",
                                self.worker_id, self._ahead.hits, self._ahead.dropped)
                self._ahead = self._leased = None

    def _read_ahead(self) -> None:
        """Start reading the next leased task's records (read_ahead.py)."""
        task = self._leased.peek() if self._leased is not None else None
        if self._ahead is None or task is None or task.type not in (
                TaskType.TRAINING, TaskType.EVALUATION, TaskType.PREDICTION):
            return
        reader = self.readers.get(task.type)
        if reader is not None and not isinstance(reader, TorchDatasetReader):
            self._ahead.start(task)

    def run_task(self, task: Task) -> None:
        if self.trainer.sequence is not None:  # a carried model state: where it starts
            self.trainer.sequence.begin_task(task)
        self._skipped_in_task = self._records_skipped = 0
        self._loss_sum, self._loss_records = 0.0, 0
        counters: dict[str, int] = {}
        try:
            records = self._read(task)
            if task.type == TaskType.EVALUATION_FINALIZE:
                self.source.report_evaluation(task, self._metrics.finalize(task.metric_states))
            elif records is None:
                raise ValueError(f"unexpected task type {task.type!r}")
            elif task.type == TaskType.TRAINING:
                self.trainer.collapse_counters()   # (a failed task's leftovers: dropped)
                self._train(task, records)
                counters = self.trainer.finish_task(task)  # e.g. what the PS applied
                counters.update(self.trainer.collapse_counters())
            elif task.type == TaskType.EVALUATION:
                self.source.report_evaluation(task, *self._evaluate(task, records))
            elif task.type == TaskType.PREDICTION:
                self._predict(task, records)
            else:
                raise ValueError(f"unexpected task type {task.type!r}")
        except DataError as e:
            logger.error("task %d: bad data: %s", task.task_id, e)
            self._reporter.report_task(task, str(e), traceback.format_exc(), fatal=True)
            raise
        except NonFiniteError as e:
            # the step was not applied: the model is intact, so the worker goes on;
            # the master re-queues the task and fails the job after
            # --max_task_retries with this as the root cause
            logger.error("task %d failed: %s", task.task_id, e)
            self._reporter.report_task(task, f"NonFiniteError: {e}", traceback.format_exc())
            return
        except Exception as e:  # reported with its traceback, then re-raised
            self._reporter.report_task(task, f"{type(e).__name__}: {e}", traceback.format_exc())
            raise
        if counters and records is not None:
            counters["records_read"] = records.num_records  # a reader may return fewer
        if self._skipped_in_task:
            counters["nonfinite_steps_skipped"] = self._skipped_in_task
            counters["records_skipped"] = self._records_skipped
        loss = float(self._loss_sum) / self._loss_records if self._loss_records else None
        lr = self.trainer.last_lr if task.type == TaskType.TRAINING else None
        self._reporter.report_task(task, counters=counters or None, loss=loss, learning_rate=lr)
        self.stats.tasks += 1
        for cb in self.after_task:
            cb(task)

    def _read(self, task: Task) -> Optional[TaskRecords]:
        if task.type == TaskType.EVALUATION_FINALIZE:
            return None  # its input are the metric states it carries
        ahead = self._ahead.take(task) if self._ahead is not None else None
        records = ahead if ahead is not None else self._read_records(task)
        self._read_ahead()   # the next task's, while this one trains
        return records

    def _read_records(self, task: Task) -> TaskRecords:
        reader = self.readers.get(task.type)
        if reader is None:
            raise DataError(f"no {MODES[task.type]} data configured for task {task.task_id}")
        return TaskRecords(reader, task, MODES[task.type], self._size(task),
                           self.spec.feed_batch)

    def _size(self, task: Task) -> int:
        return self.minibatch_size if task.type == TaskType.TRAINING else \
            self.eval_minibatch_size

    def _minibatches(self, task: Task, records: Sequence[Any]
                     ) -> Iterator[tuple[int, Any, Any]]:
        """``(records done in the task, features, labels)`` per minibatch of ``records``."""
        made = TaskRecords.of(records, task, MODES[task.type], self._size(task),
                              self.spec.feed_batch)
        for mb in self._produce(made):
            yield mb.stop, mb.features, mb.labels

    def _produce(self, records: TaskRecords, skip: frozenset[int] = frozenset()
                 ) -> Generator[Minibatch, None, None]:
        """The task's minibatches but ``skip`` (0-based), made ahead in a thread (stopped
        when the caller stops, e.g. on a failed step)."""
        batches = records.produce(skip)
        try:
            yield from batches
        finally:
            batches.close()

    def _train(self, task: Task, records: TaskRecords) -> None:
        # pushed by an earlier holder (1-based): skipped, neither read nor fed
        applied = self.trainer.start_task(task)
        minibatches = self._produce(records, frozenset(k - 1 for k in applied))
        try:
            self._train_minibatches(task, minibatches)
        finally:
            minibatches.close()
        self.stats.train_records += records.num_records

    def _train_minibatches(self, task: Task, minibatches: Iterator[Minibatch]) -> None:
        for mb in minibatches:
            k, size, done = mb.index + 1, mb.size, mb.stop
            features, labels = mb.features, mb.labels
            self.trainer.set_position(task.task_id, k, size)
            try:
                loss = self.trainer.train_minibatch(features, labels)
            except NonFiniteError as e:
                e.locate(f"step {self.stats.steps + 1} (task {task.task_id}, epoch "
                         f"{task.epoch}, records {task.start + done - size}-"
                         f"{task.start + done} of {task.shard_name})")
                if not self.skip_nonfinite_steps:
                    raise
                self.stats.nonfinite_skipped += 1
                self._skipped_in_task += 1
                self._records_skipped += size
                logger.warning("skipped: %s (--skip_nonfinite_steps; %d skipped so far)", e,
                               self.stats.nonfinite_skipped)
                continue
            self.stats.steps += 1
            self._loss_sum += loss.detach() * size  # a tensor: no device sync per step
            self._loss_records += size
            for cb in self.after_train_step:
                cb(task, done, loss)

    def _evaluate(self, task: Task, records: TaskRecords) -> tuple[list[Metric], bytes]:
        """The task's plain metrics and its stateful metrics' serialised states."""
        self._metrics.begin_task()
        minibatches = self._produce(records)
        try:
            for mb in minibatches:
                outputs = self.trainer.forward(mb.features)
                n = batch_size_of(mb.labels, mb.features)
                labels = to_device(mb.labels, self.trainer.device)
                self._metrics.update(labels, outputs, n)
        finally:
            minibatches.close()
        self.stats.eval_records += records.num_records
        return self._metrics.end_task()

    def _predict(self, task: Task, records: TaskRecords) -> None:
        if self.prediction_sink is None:
            raise RuntimeError("prediction task without a prediction sink")
        outputs = []
        minibatches = self._produce(records)
        try:
            for mb in minibatches:
                outputs.append(self.trainer.forward(mb.features))
        finally:
            minibatches.close()
        index = np.arange(task.start, task.end, dtype=np.int64)
        self.prediction_sink.write(task, index, outputs, self.worker_id)
        self.stats.predict_records += records.num_records
