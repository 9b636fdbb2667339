"""The one task poller: bounded waits, and the one minibatch slicing rule."""

from __future__ import annotations

import pytest

from elasticdl.common.task import TaskType
from elasticdl.local.task_source import LocalTaskSource
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.task_manager import TaskManager
from elasticdl.worker.poller import TaskPoller, minibatch_count, minibatch_slice


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_gives_up_after_the_maximum_wait_on_a_real_task_manager():
    tm = TaskManager(training_shards=[("s", 0, 10)], records_per_task=10)
    held = tm.get(1)  # another worker holds the only task: worker 0 is told to WAIT
    assert held.type == TaskType.TRAINING
    clock = Clock()
    poller = TaskPoller(LocalTaskSource(tm, EvaluationAggregator(), worker_id=0), wait_s=0.5,
                        max_wait_s=3.0, clock=clock, sleep=clock.sleep)
    with pytest.raises(TimeoutError, match="told to wait for 3 s"):
        poller.next_task()
    assert clock.sleeps == [0.5] * 6 and clock.now == 3.0


def test_a_task_ends_the_wait_and_restarts_the_clock():
    tm = TaskManager(training_shards=[("s", 0, 20)], records_per_task=10)
    first, second = tm.get(1), tm.get(1)
    clock = Clock()
    source = LocalTaskSource(tm, EvaluationAggregator(), worker_id=0)
    poller = TaskPoller(source, wait_s=1.0, max_wait_s=2.5, clock=clock, sleep=clock.sleep)
    assert poller.poll().type == TaskType.WAIT and poller.waited_s == 1.0
    assert poller.poll().type == TaskType.WAIT
    tm.report(first.task_id, 1, False, "boom")  # failed: re-queued for anyone
    task = poller.next_task()
    assert task.task_id == first.task_id and poller.waited_s == 0.0
    tm.report(second.task_id, 1, True)
    # worker 0 holds the last task: told to wait again, with a fresh budget
    assert poller.poll().type == TaskType.WAIT
    tm.report(task.task_id, 0, True)
    assert poller.next_task().type == TaskType.NONE


def test_work_done_while_waiting_skips_the_pause_and_the_deadline():
    tm = TaskManager(training_shards=[("s", 0, 10)], records_per_task=10)
    tm.get(1)  # held by another worker: worker 0 is told to WAIT
    clock = Clock()
    poller = TaskPoller(LocalTaskSource(tm, EvaluationAggregator()), wait_s=1.0,
                        max_wait_s=1.0, clock=clock, sleep=clock.sleep)
    rounds = iter([False, False, True, True])
    for _ in range(3):
        assert poller.poll(while_waiting=lambda: next(rounds)).type == TaskType.WAIT
    assert clock.sleeps == [1.0]  # only the idle round paused
    with pytest.raises(TimeoutError):
        poller.poll(while_waiting=lambda: next(rounds))


@pytest.mark.parametrize("wait_s,max_wait_s", [(-1, 1), (0.1, 0)])
def test_bad_wait_settings_are_refused(wait_s, max_wait_s):
    with pytest.raises(ValueError):
        TaskPoller(None, wait_s, max_wait_s)  # type: ignore[arg-type]


def test_minibatch_slices_cover_a_task_once():
    slices = [minibatch_slice(k, 37, 16) for k in range(minibatch_count(37, 16))]
    assert slices == [slice(0, 16), slice(16, 32), slice(32, 37)]
    assert minibatch_count(0, 16) == 0 and minibatch_count(32, 16) == 2
    with pytest.raises(ValueError):
        minibatch_slice(3, 37, 16)
    with pytest.raises(ValueError):
        minibatch_count(10, 0)


def test_allreduce_member_serving_the_rest_gives_up_after_the_maximum_wait():
    """After its group finished, an allreduce member serves the remaining evaluation
    tasks; while another worker holds the last task it is told to WAIT, and it now
    gives up after the maximum wait instead of polling forever."""
    import time
    from types import SimpleNamespace

    from elasticdl.worker.allreduce_trainer import AllreduceTrainer

    tm = TaskManager(evaluation_shards=[("v", 0, 20)], records_per_task=10)
    tm.create_evaluation_tasks(0)
    ran: list[int] = []

    def run_task(task):
        ran.append(task.task_id)
        tm.report(task.task_id, 0, True)

    held = tm.get(1)  # another worker holds one of the two evaluation tasks
    loop = SimpleNamespace(max_wait_s=0.5, run_task=run_task)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="told to wait"):
        AllreduceTrainer._serve_rest(None, LocalTaskSource(tm, EvaluationAggregator()),  # type: ignore[arg-type]
                                     loop, 0.02)  # type: ignore[arg-type]
    assert 0.5 <= time.monotonic() - start < 30
    assert len(ran) == 1 and ran[0] != held.task_id
