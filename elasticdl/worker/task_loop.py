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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from elasticdl.api.model_spec import ModelSpec
from elasticdl.common.task import Task, TaskType
from elasticdl.data.api import DataError, DataReader, MalformedRecordError
from elasticdl.worker.eval_metrics import EvalMetrics
from elasticdl.worker.poller import DEFAULT_MAX_WAIT_S, TaskPoller, minibatch_count, minibatch_slice
from elasticdl.worker.prediction import PredictionSink
from elasticdl.worker.task_source import Metric, TaskSource
from elasticdl.worker.trainer import NonFiniteError, Trainer, batch_size_of, to_device

logger = logging.getLogger(__name__)

MODES = {TaskType.TRAINING: "training", TaskType.EVALUATION: "evaluation",
         TaskType.PREDICTION: "prediction", TaskType.EVALUATION_FINALIZE: "evaluation"}

StepCallback = Callable[[Task, int, torch.Tensor], None]


class FeedError(DataError):
    """``feed`` failed on a minibatch although each record alone was accepted."""


def feed_records(feed: Callable[..., Any], records: Sequence[Any], mode: str, shard: str,
                 start: int) -> tuple[Any, Any]:
    """Run the user's ``feed``; on failure, find and name the first bad record."""
    try:
        return feed(records, mode)
    except Exception as batch_error:  # user code: re-raised as a structured data error
        for i, record in enumerate(records):
            try:
                feed([record], mode)
            except Exception as e:  # noqa: BLE001 - named and re-raised below
                raise MalformedRecordError(shard, start + i,
                                           f"feed rejected it: {type(e).__name__}: {e}") from e
        raise FeedError(f"feed failed on records {start}-{start + len(records)} of {shard}: "
                        f"{type(batch_error).__name__}: {batch_error}") from batch_error


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
    """

    def __init__(self, source: TaskSource, trainer: Trainer, spec: ModelSpec,
                 readers: dict[TaskType, DataReader], minibatch_size: int,
                 worker_id: int = 0, prediction_sink: Optional[PredictionSink] = None,
                 after_train_step: Sequence[StepCallback] = (),
                 after_task: Sequence[Callable[[Task], None]] = (),
                 wait_s: float = 0.2, max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 skip_nonfinite_steps: bool = False, eval_minibatch_size: int = 0):
        self.source = source
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

    def run(self) -> LoopStats:
        """Run tasks until the source has none left.

        Raises:
            TimeoutError: told to wait for ``max_wait_s`` in a row.
            DataError / Exception: a task failed (reported first, see the module).
        """
        poller = TaskPoller(self.source, self.wait_s, self.max_wait_s)
        while True:
            task = poller.next_task()
            if task.type == TaskType.NONE:
                return self.stats
            if self.stats.tasks == 0:
                logger.info("worker %d: first task %d (%s, records %d-%d of %s)",
                            self.worker_id, task.task_id, MODES.get(task.type, task.type),
                            task.start, task.end, task.shard_name)
            self.run_task(task)

    def run_task(self, task: Task) -> None:
        if self.trainer.sequence is not None:  # a carried model state: where it starts
            self.trainer.sequence.begin_task(task)
        self._skipped_in_task = self._records_skipped = 0
        self._loss_sum, self._loss_records = 0.0, 0
        counters: dict[str, int] = {}
        try:
            records = self._read(task)
            if task.type == TaskType.TRAINING:
                self._train(task, records)
                counters = self.trainer.finish_task(task)  # e.g. what the PS applied
            elif task.type == TaskType.EVALUATION:
                self.source.report_evaluation(task, *self._evaluate(task, records))
            elif task.type == TaskType.EVALUATION_FINALIZE:
                self.source.report_evaluation(task, self._metrics.finalize(task.metric_states))
            elif task.type == TaskType.PREDICTION:
                self._predict(task, records)
            else:
                raise ValueError(f"unexpected task type {task.type!r}")
        except DataError as e:
            logger.error("task %d: bad data: %s", task.task_id, e)
            self.source.report_task(task, str(e), traceback.format_exc(), fatal=True)
            raise
        except NonFiniteError as e:
            # the step was not applied: the model is intact, so the worker goes on;
            # the master re-queues the task and fails the job after
            # --max_task_retries with this as the root cause
            logger.error("task %d failed: %s", task.task_id, e)
            self.source.report_task(task, f"NonFiniteError: {e}", traceback.format_exc())
            return
        except Exception as e:  # reported with its traceback, then re-raised
            self.source.report_task(task, f"{type(e).__name__}: {e}", traceback.format_exc())
            raise
        if counters:
            counters["records_read"] = len(records)  # a reader may return fewer
        if self._skipped_in_task:
            counters["nonfinite_steps_skipped"] = self._skipped_in_task
            counters["records_skipped"] = self._records_skipped
        loss = float(self._loss_sum) / self._loss_records if self._loss_records else None
        lr = self.trainer.last_lr if task.type == TaskType.TRAINING else None
        self.source.report_task(task, counters=counters or None, loss=loss, learning_rate=lr)
        self.stats.tasks += 1
        for cb in self.after_task:
            cb(task)

    def _read(self, task: Task) -> list[Any]:
        if task.type == TaskType.EVALUATION_FINALIZE:
            return []  # its input are the metric states it carries
        reader = self.readers.get(task.type)
        if reader is None:
            raise DataError(f"no {MODES[task.type]} data configured for task {task.task_id}")
        return reader.read(task.shard_name, task.start, task.end)

    def _minibatches(self, task: Task, records: Sequence[Any]):
        mode = MODES[task.type]
        size = self.minibatch_size if task.type == TaskType.TRAINING else \
            self.eval_minibatch_size
        for k in range(minibatch_count(len(records), size)):
            s = minibatch_slice(k, len(records), size)
            features, labels = feed_records(self.spec.feed_batch, records[s], mode, task.shard_name,
                                            task.start + s.start)
            yield s.stop, features, labels

    def _train(self, task: Task, records: Sequence[Any]) -> None:
        applied = self.trainer.start_task(task)  # pushed by an earlier holder: skipped
        previous = 0
        for k, (done, features, labels) in enumerate(self._minibatches(task, records), 1):
            size, previous = done - previous, done
            if k in applied:
                continue
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
        self.stats.train_records += len(records)

    def _evaluate(self, task: Task, records: Sequence[Any]) -> tuple[list[Metric], bytes]:
        """The task's plain metrics and its stateful metrics' serialised states."""
        self._metrics.begin_task()
        for _, features, labels in self._minibatches(task, records):
            outputs = self.trainer.forward(features)
            n = batch_size_of(labels, features)
            labels = to_device(labels, self.trainer.device)
            self._metrics.update(labels, outputs, n)
        self.stats.eval_records += len(records)
        return self._metrics.end_task()

    def _predict(self, task: Task, records: Sequence[Any]) -> None:
        if self.prediction_sink is None:
            raise RuntimeError("prediction task without a prediction sink")
        outputs = []
        for _, features, _labels in self._minibatches(task, records):
            outputs.append(self.trainer.forward(features))
        index = np.arange(task.start, task.end, dtype=np.int64)
        self.prediction_sink.write(task, index, outputs, self.worker_id)
        self.stats.predict_records += len(records)
