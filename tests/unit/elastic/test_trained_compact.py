"""The allreduce trained-record set keeps only tasks the master has not closed
(docs/scale.md): what a joiner receives and a checkpoint records stay O(live),
and closed tasks count as wholly in the model."""

from __future__ import annotations

import json

from elasticdl.checkpoint import data_position as dp
from elasticdl.common.intervals import IntervalSet
from elasticdl.common.task import Task, TaskType
from elasticdl.common.wire import task_from_proto, task_to_proto
from elasticdl.elastic.trained import TrainedRecords
from elasticdl.master.ps_settle import ClosedSnapshot
from elasticdl.worker.elastic_dataset import BatchTag, _TaskState

MB = 4
BASE = 117668364739280898   # a run's task ids start at a large base


def _tags(task_id: int, n: int) -> list[BatchTag]:
    state = _TaskState(Task(task_id, TaskType.TRAINING, "s", 0, n * MB), list(range(n * MB)), n)
    return [BatchTag(state, i, MB) for i in range(n)]


def _train(trained: TrainedRecords, task_id: int, n: int = 2) -> None:
    tags = _tags(task_id, n)
    trained.record(trained.encode(tags, rank=0, world_size=1, slots=n))


def test_closed_tasks_leave_the_set_and_count_as_trained():
    trained = TrainedRecords(MB)
    for t in range(5):
        _train(trained, BASE + t)
    assert trained.settle(-1, IntervalSet([(BASE, BASE + 3)])) == 6
    assert trained.entries() == [(BASE + t, o, MB) for t in (3, 4) for o in (0, MB)]
    assert trained.holds(_tags(BASE + 1, 2)[1]) and trained.minibatches_of(BASE, 2) == {0, 1}
    assert not trained.holds(_tags(BASE + 7, 2)[0])
    _train(trained, BASE + 2)              # a straggler's step of a closed task: not kept
    assert len(trained.entries()) == 4
    assert trained.settle(-2, IntervalSet([(BASE, BASE + 5)])) is None   # older: ignored
    assert len(trained.entries()) == 4
    copy = TrainedRecords(MB)              # the joiner's state, and the round trip
    copy.load_state_dict(json.loads(json.dumps(trained.state_dict())))
    assert copy.entries() == trained.entries() and copy.closed == trained.closed
    assert copy.minibatches_of(BASE + 1, 2) == {0, 1}


def test_joiner_state_and_checkpoint_stay_small_as_the_job_goes_on(tmp_path):
    trained = TrainedRecords(MB)
    sizes = []
    for t in range(2000):
        _train(trained, BASE + t)
        if t % 100 == 99:   # the master closes all but the last 10 tasks
            trained.settle(-1, IntervalSet([(BASE, BASE + t - 10)]))
            sizes.append(len(json.dumps(trained.state_dict())))
    assert max(sizes) <= min(sizes) * 1.2, sizes   # flat, not growing with the job
    assert len(trained.entries()) <= 2 * 20
    vdir = str(tmp_path / "version-9")
    dp.write_trained_compact(vdir, "group", trained.generation, trained.closed,
                             trained.entries())
    got = dp.read_trained_set(vdir)
    assert got is not None and BASE + 5 in got.closed
    assert set(got.entries) == {BASE + t for t in range(1989, 2000)}


def test_closed_set_travels_with_training_tasks():
    task = Task(BASE, TaskType.TRAINING, "s", 0, 8, closed=(3, (BASE - 10, BASE)))
    msg = task_to_proto(task)
    msg.closed_generation, msg.has_closed = 3, True
    msg.closed.extend([BASE - 10, BASE])
    back = task_from_proto(msg)
    assert back == task and back.closed == (3, (BASE - 10, BASE))
    assert task_from_proto(task_to_proto(Task(1, TaskType.TRAINING, "s", 0, 8))).closed is None


def test_closed_snapshot_is_refreshed_at_most_every_max_age():
    class Core:
        calls = 0

        def closed_tasks(self):
            Core.calls += 1
            return -1, IntervalSet([(0, Core.calls)])

    snap = ClosedSnapshot(Core(), max_age_s=60)
    assert snap.get() == (-1, [0, 1]) and snap.get() == (-1, [0, 1]) and Core.calls == 1
