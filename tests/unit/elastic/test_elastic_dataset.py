"""ElasticDataset bookkeeping against a real TaskManager and a scripted runner:
tasks are reported only once their steps are confirmed, lost steps are trained
again, skipped batches count, WAIT joins rounds, NONE ends training."""

from __future__ import annotations

from typing import Any, Optional

import torch

from elasticdl.elastic.runner import RoundResult, RoundStatus
from elasticdl.local.task_source import LocalTaskSource
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.task_manager import TaskManager
from elasticdl.worker.elastic_dataset import ElasticDataset, ElasticLoopContext, batch_records


class ScriptedRunner:
    """Confirms a round's microbatches when the next round starts (like the real one)."""

    def __init__(self) -> None:
        self.on_confirmed: Any = None
        self.on_lost: Any = None
        self.unconfirmed: list[Any] = []
        self.pending = 0
        self.step_fn: Any = None
        self.events: list[str] = []
        self.is_filler = False
        self.state: Any = None
        self.group: Any = None
        self.trained: Any = None   # no record of what is in the model: nothing skipped

    def _next_round(self) -> None:
        tags, self.unconfirmed = self.unconfirmed, []
        if tags:
            self.on_confirmed(tags)

    def submit(self, fn: Any, args: tuple, records: int, tag: Any = None) -> RoundResult:
        self._next_round()
        out = fn(*args)
        self.unconfirmed.append(tag)
        self.events.append(f"step {records}")
        return RoundResult(RoundStatus.STEPPED, 0, [out], [tag])

    def flush(self) -> RoundResult:
        self._next_round()
        self.events.append("idle")
        return RoundResult(RoundStatus.IDLE, 0)

    def leave_round(self) -> RoundResult:
        self._next_round()
        self.events.append("leave")
        return RoundResult(RoundStatus.DONE, 0)

    def lose_unconfirmed(self) -> None:
        tags, self.unconfirmed = self.unconfirmed, []
        self.on_lost(tags)


def _setup(n: int, per_task: int, mb: int, epochs: int = 1, **tm_kw: Any):
    tm = TaskManager(training_shards=[("s", 0, n)], records_per_task=per_task,
                     num_epochs=epochs, **tm_kw)
    reported: list[int] = []
    source = LocalTaskSource(tm, EvaluationAggregator())
    orig = source.report_task

    def report(task, error="", traceback="", fatal=False, **kw):
        reported.append(task.task_id if not error else -task.task_id - 1)
        orig(task, error, traceback, fatal, **kw)

    source.report_task = report  # type: ignore[method-assign]
    runner = ScriptedRunner()

    def read(task):
        return list(range(task.start, task.end))

    def feed(records, task, offset):
        x = torch.tensor(records, dtype=torch.float32)
        return x, x

    ds = ElasticDataset(runner, source, read, feed, mb, wait_s=0.0,  # type: ignore[arg-type]
                        max_wait_s=10.0)
    return tm, ds, runner, reported


def _train(ds: ElasticDataset, runner: ScriptedRunner, seen: list[int],
           hook: Optional[Any] = None) -> None:
    for i, (x, _y) in enumerate(ds):
        tag = ds.take_current()
        runner.submit(lambda x=x: seen.extend(int(v) for v in x), (), tag.records, tag)
        if hook is not None:
            hook(i)


def test_tasks_are_reported_only_after_their_steps_are_confirmed():
    tm, ds, runner, reported = _setup(40, 40, 16)
    seen: list[int] = []
    states = []
    _train(ds, runner, seen, hook=lambda i: states.append(list(reported)))
    assert seen == list(range(40))
    # batches 16, 16, 8; after the last step the task is still unconfirmed
    assert states == [[], [], []]
    # the master says WAIT while the task is held: the idle round confirms it
    assert runner.events == ["step 16", "step 16", "step 8", "idle", "leave"]
    assert reported == [0]
    assert tm.finished() and tm.epochs_report()[0]["records_completed"] == 40
    assert ds.records_trained == 40 and ds.tasks_reported == 1


def test_wait_joins_a_round_and_none_ends_training():
    tm, ds, runner, reported = _setup(32, 16, 16)
    seen: list[int] = []
    _train(ds, runner, seen)
    # the last task's confirmation came from the idle round joined on WAIT
    assert "idle" in runner.events and runner.events[-1] == "leave"
    assert reported == [0, 1] and tm.finished()


def test_lost_steps_are_trained_again_before_the_task_counts():
    tm, ds, runner, reported = _setup(48, 48, 16)
    seen: list[int] = []

    def lose_once(i: int) -> None:
        if i == 1 and not getattr(lose_once, "done", False):
            lose_once.done = True  # type: ignore[attr-defined]
            runner.lose_unconfirmed()   # e.g. this worker had to re-join

    _train(ds, runner, seen, hook=lose_once)
    assert seen == list(range(16)) + list(range(16, 32)) * 2 + list(range(32, 48))
    assert reported == [0]
    assert tm.epochs_report()[0]["records_completed"] == 48


def test_a_batch_the_loop_skips_counts_as_consumed():
    tm, ds, runner, reported = _setup(32, 32, 16)
    trained = []
    for i, (x, _y) in enumerate(ds):
        if i == 0:
            continue  # the user's loop skips it
        tag = ds.take_current()
        runner.submit(lambda x=x: trained.append(x.tolist()), (), tag.records, tag)
    assert len(trained) == 1 and reported == [0]


def test_evaluation_tasks_go_to_the_handler():
    tm, ds, runner, reported = _setup(16, 16, 16)
    tm.create_evaluation_tasks(0)  # no validation shards: nothing queued
    handled: list[int] = []

    def run_other(task):
        handled.append(task.task_id)
        ds.source.report_task(task)

    ds.run_other_task = run_other
    ds.max_wait_s = 10.0
    tm._eval_pieces = [("v", 0, 8)]  # one evaluation task
    tm.create_evaluation_tasks(5)
    _train(ds, runner, [])
    assert len(handled) == 1


def test_unfinished_tasks_are_handed_back_when_the_group_stops():
    tm, ds, runner, reported = _setup(64, 32, 16)
    it = iter(ds)
    next(it)  # one batch of task 0 yielded, never stepped; now the group says DONE
    ds._stopped()
    assert reported and reported[0] < 0  # reported as failed: the master re-queues it
    assert tm.counts()["todo"] >= 1


def test_batch_records_finds_the_batch_dimension():
    assert batch_records((torch.zeros(5, 3), torch.zeros(5))) == 5
    assert batch_records(({"a": torch.zeros(7, 2)},)) == 7


def test_train_loop_context_step_wrapper_passes_the_batch_tag():
    tm, ds, runner, reported = _setup(32, 32, 16)
    ctx = ElasticLoopContext(runner, ds, torch.device("cpu"))  # type: ignore[arg-type]
    seen: list[int] = []

    @ctx.step
    def train_step(x, y):
        seen.extend(int(v) for v in x)
        return "loss"

    outs = [train_step(x, y) for x, y in ctx.dataset]
    assert outs == ["loss", "loss"] and seen == list(range(32)) and reported == [0]
    assert runner.step_fn is not None


def test_a_requeued_tasks_minibatches_in_the_model_are_skipped():
    """A task whose earlier holder died after stepping some of its minibatches: the
    group's record of what is in the model says which; only the others are trained,
    and the task still counts all its records."""
    from elasticdl.elastic.trained import TrainedRecords

    tm, ds, runner, reported = _setup(64, 32, 8)   # tasks 0 (0..31), 1 (32..63)
    runner.trained = TrainedRecords(minibatch_size=8)
    runner.trained.agreed.update({(0, 0): 8, (0, 16): 8, (1, 0): 8, (1, 8): 8,
                                  (1, 16): 8, (1, 24): 8})   # task 1: all of it
    seen: list[int] = []
    _train(ds, runner, seen)
    assert seen == list(range(8, 16)) + list(range(24, 32))
    assert sorted(reported) == [0, 1]
    assert tm.epochs_report()[0]["records_completed"] == 64
    assert ds.records_trained == 16
