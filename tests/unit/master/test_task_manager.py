import pytest

from elasticdl.common.task import TaskType
from elasticdl.master.task_manager import TaskManager


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def drain(tm, worker=0, fail_ids=()):
    seen = []
    while True:
        t = tm.get(worker)
        if t.type in (TaskType.NONE, TaskType.WAIT):
            return seen
        seen.append(t)
        tm.report(t.task_id, worker, t.task_id not in fail_ids, "boom")


def test_tasks_cover_shards_exactly_per_epoch():
    tm = TaskManager([("a", 0, 100), ("b", 10, 35)], records_per_task=32, num_epochs=2)
    tasks = drain(tm)
    for epoch in (0, 1):
        ranges = sorted((t.shard_name, t.start, t.end) for t in tasks if t.epoch == epoch)
        assert ranges == [("a", 0, 32), ("a", 32, 64), ("a", 64, 96), ("a", 96, 100),
                          ("b", 10, 42), ("b", 42, 45)]
    assert tm.finished()
    assert tm.epochs_report() == [{"epoch": 0, "records_completed": 135, "records_redone": 0,
                                   "records_applied": 135},
                                  {"epoch": 1, "records_completed": 135, "records_redone": 0,
                                   "records_applied": 135}]


def test_shuffle_is_seeded_and_complete():
    a = TaskManager([("a", 0, 1000)], records_per_task=10, shuffle=True, seed=3)
    b = TaskManager([("a", 0, 1000)], records_per_task=10, shuffle=True, seed=3)
    ta, tb = [t.start for t in drain(a)], [t.start for t in drain(b)]
    assert ta == tb and ta != sorted(ta) and sorted(ta) == list(range(0, 1000, 10))


def test_wait_while_others_hold_tasks_then_requeue_on_death():
    tm = TaskManager([("a", 0, 20)], records_per_task=10)
    t1, t2 = tm.get(1), tm.get(2)
    assert tm.get(3).type == TaskType.WAIT
    tm.report(t1.task_id, 1, True)
    assert tm.recover_tasks(2) == [t2]
    again = tm.get(3)
    assert (again.start, again.end) == (t2.start, t2.end)
    tm.report(again.task_id, 3, True)
    assert tm.get(3).type == TaskType.NONE
    assert tm.epochs_report()[0] == {"epoch": 0, "records_completed": 20, "records_redone": 10,
                                     "records_applied": 20}


def test_retry_cap_fails_job_with_root_cause():
    tm = TaskManager([("a", 0, 10)], records_per_task=10, max_task_retries=3)
    for attempt in range(3):
        t = tm.get(0)
        assert t.type == TaskType.TRAINING, attempt
        tm.report(t.task_id, 0, False, f"bad record {attempt}", "tb")
    assert tm.failure is not None and tm.failure.attempts == 3
    assert "bad record 2" in tm.failure.describe() and "records 0-10 of a" in \
        tm.failure.describe()
    assert tm.get(0).type == TaskType.NONE and not tm.finished()


def test_fatal_failure_fails_at_once():
    tm = TaskManager([("a", 0, 10)], records_per_task=10, max_task_retries=5)
    t = tm.get(0)
    tm.report(t.task_id, 0, False, "malformed record 3", fatal=True)
    assert tm.failure is not None and tm.failure.attempts == 1


def test_straggler_reassigned_and_counted_once():
    clock = Clock()
    tm = TaskManager([("a", 0, 50)], records_per_task=10, task_timeout_s=5, clock=clock)
    slow = tm.get(1)
    for _ in range(4):
        t = tm.get(2)
        tm.report(t.task_id, 2, True)
    clock.t = 10
    again = tm.get(2)
    assert again.task_id == slow.task_id
    tm.report(slow.task_id, 1, True)      # the straggler finishes first: counts
    tm.report(again.task_id, 2, True)     # the copy: ignored
    assert tm.get(2).type == TaskType.NONE and tm.finished()
    assert tm.epochs_report()[0]["records_completed"] == 50


def test_straggler_done_before_copy_is_taken():
    clock = Clock()
    tm = TaskManager([("a", 0, 20)], records_per_task=10, task_timeout_s=5, clock=clock)
    held = {1: tm.get(1), 2: tm.get(2)}
    clock.t = 10
    copy = tm.get(3)          # both are re-queued; one copy is handed out
    other = next(w for w, t in held.items() if t.task_id != copy.task_id)
    # the other task's first holder finishes while its copy still waits in the queue
    tm.report(held[other].task_id, other, True)
    tm.report(copy.task_id, 3, True)
    tm.report(copy.task_id, 1 if other == 2 else 2, True)   # late report: ignored
    assert tm.get(3).type == TaskType.NONE and tm.finished()
    assert tm.epochs_report()[0]["records_completed"] == 20


def test_evaluation_tasks_first_and_callbacks():
    tm = TaskManager([("a", 0, 20)], [("v", 0, 15)], records_per_task=10)
    done, epochs = [], []
    tm.evaluation_done_callbacks.append(done.append)
    tm.epoch_end_callbacks.append(epochs.append)
    assert tm.create_evaluation_tasks(7)
    assert not tm.create_evaluation_tasks(7)
    tasks = drain(tm)
    assert [t.type for t in tasks[:2]] == [TaskType.EVALUATION] * 2
    assert tasks[0].model_version == 7 and done == [7] and epochs == [0]
    assert tm.evaluation_records_completed == 15


def test_state_dict_resume_mid_task():
    tm = TaskManager([("a", 0, 100)], records_per_task=20, num_epochs=2)
    t0 = tm.get(0)
    tm.report(t0.task_id, 0, True)
    t1 = tm.get(0)
    state = tm.state_dict(partial={t1.task_id: 5})
    resumed = TaskManager([("a", 0, 100)], records_per_task=20, num_epochs=2)
    resumed.load_state_dict(state)
    assert resumed.training_records_left() == 75 + 100
    tasks = drain(resumed)
    first = sorted((t.start, t.end) for t in tasks if t.epoch == 0)
    assert first == [(25, 40), (40, 60), (60, 80), (80, 100)]
    assert len([t for t in tasks if t.epoch == 1]) == 5
    assert [e["records_completed"] for e in resumed.epochs_report()] == [100, 100]


def test_prediction_tasks_and_bad_args():
    tm = TaskManager(prediction_shards=[("p", 0, 25)], records_per_task=10)
    tasks = drain(tm)
    assert [t.type for t in tasks] == [TaskType.PREDICTION] * 3
    assert tm.prediction_ledger.records_completed == 25
    with pytest.raises(ValueError):
        TaskManager(records_per_task=0)
