"""The data position of distributed checkpoints (torch-free master side): the task
table, trained-records sidecars, and the TaskManager state a resume builds from them.
The effect end to end (kill -9 and resume, every record once) is in
tests/integration/test_resume_distributed.py."""

from __future__ import annotations

import os

import pytest

from elasticdl.checkpoint import data_position as dp
from elasticdl.checkpoint.paths import CheckpointError, version_dir
from elasticdl.common.task import Task, TaskType
from elasticdl.master.task_manager import TaskManager

SHARDS = [("a", 0, 32), ("b", 0, 32)]   # 64 records, 4 tasks of 16, minibatches of 4
MB = 4


def _tm(**kw) -> TaskManager:
    return TaskManager(SHARDS, records_per_task=16, num_epochs=2, shuffle=True, seed=5,
                       first_task_id=kw.pop("first_task_id", 1000), **kw)


def _done(ckpt: str, version: int, writers: dict[str, list[tuple[int, int, int]]]) -> str:
    vdir = version_dir(ckpt, version)
    os.makedirs(vdir, exist_ok=True)
    for writer, entries in writers.items():
        dp.write_trained(vdir, writer, entries)
    with open(os.path.join(vdir, "DONE"), "w") as f:
        f.write(str(version))
    return vdir


def _drain(tm: TaskManager) -> dict[tuple[str, int], int]:
    """Train every task left; returns how often each (shard, record) was trained."""
    seen: dict[tuple[str, int], int] = {}
    while True:
        task = tm.get(0)
        if task.type != TaskType.TRAINING:
            assert task.type == TaskType.NONE
            return seen
        for r in range(task.start, task.end):
            seen[(task.shard_name, r)] = seen.get((task.shard_name, r), 0) + 1
        tm.report(task.task_id, 0, True)


def test_untrained_ranges_are_the_holes_and_the_tail():
    task = Task(7, TaskType.TRAINING, "a", 100, 132)
    assert dp.untrained_ranges(task, {}) == [(100, 132)]
    assert dp.untrained_ranges(task, {0: 4, 4: 4, 12: 4}) == [(108, 112), (116, 132)]
    assert dp.untrained_ranges(task, {o: 4 for o in range(0, 32, 4)}) == []
    assert dp.untrained_ranges(task, {28: 2}) == [(100, 128), (130, 132)]


def test_every_ps_must_have_a_minibatch_for_it_to_count(tmp_path):
    vdir = _done(str(tmp_path), 5, {"ps-0-of-2": [(1, 0, 4), (1, 4, 4), (2, 0, 4)],
                                    "ps-1-of-2": [(1, 0, 4), (2, 0, 4), (2, 4, 4)]})
    assert dp.read_trained(vdir) == {1: {0: 4}, 2: {0: 4}}


def test_checkpoint_without_sidecar_resumes_nothing_and_one_without_table_fails(tmp_path):
    ckpt = str(tmp_path / "c")
    _done(ckpt, 3, {})
    assert dp.resume_state(ckpt) is None        # e.g. written by an older version
    _done(ckpt, 4, {"group": [(1, 0, 4)]})
    with pytest.raises(CheckpointError, match="task table"):
        dp.resume_state(ckpt)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        dp.resume_state(str(tmp_path / "empty"))


def test_the_table_records_each_task_before_it_is_handed_out(tmp_path):
    ckpt = str(tmp_path / "c")
    tm = _tm()
    table = dp.attach(tm, ckpt)
    assert table is not None
    first = tm.get(0)
    _, tasks = dp.read_table(ckpt)
    assert first in tasks and all(t.epoch == 0 for t in tasks) and len(tasks) == 4
    # a torn last line (master killed mid-write) is skipped
    with open(os.path.join(ckpt, dp.TABLE), "a") as f:
        f.write('{"t": 12, "s": "a", "a"')
    assert dp.read_table(ckpt)[1] == tasks
    table.close()


def _interrupt(ckpt: str, tm: TaskManager, first_ckpt_version: int) -> dict:
    """Train the first epoch and part of the second (one task half), checkpoint what is in
    the model (sidecars), and return how often each record was trained before it."""
    trained: list[tuple[int, int, int]] = []
    seen: dict[tuple[str, int], int] = {}

    def train(task: Task, upto: int) -> None:
        for off in range(0, upto, MB):
            trained.append((task.task_id, off, MB))
            for r in range(task.start + off, task.start + off + MB):
                seen[(task.shard_name, r)] = seen.get((task.shard_name, r), 0) + 1

    for _ in range(4):          # epoch 0 whole
        task = tm.get(0)
        train(task, task.num_records)
        tm.report(task.task_id, 0, True)
    a, b = tm.get(0), tm.get(1)   # epoch 1: a whole, b half; after the checkpoint: more
    train(a, a.num_records)
    train(b, 8)
    _done(ckpt, first_ckpt_version, {"ps-0-of-2": trained, "ps-1-of-2": trained})
    tm.report(a.task_id, 0, True)
    tm.get(2)                   # trained after the checkpoint: not in the model
    return seen


def test_resume_trains_each_record_once_per_epoch_even_when_resumed_twice(tmp_path):
    ckpt1, ckpt2 = str(tmp_path / "c1"), str(tmp_path / "c2")
    tm1 = _tm(first_task_id=1000)
    dp.attach(tm1, ckpt1)
    seen = _interrupt(ckpt1, tm1, 30)

    tm2 = _tm(first_task_id=5000)
    dp.attach(tm2, ckpt2, ckpt1)
    assert [e["records_completed"] for e in tm2.epochs_report()] == [64, 24]
    # the resumed run is interrupted too: run 2 trains its first pending task, checkpoints
    first = tm2.get(0)
    assert first.task_id >= 5000 and first.epoch == 1
    part = [(first.task_id, off, MB) for off in range(0, first.num_records, MB)]
    for r in range(first.start, first.end):
        seen[(first.shard_name, r)] = seen.get((first.shard_name, r), 0) + 1
    _done(ckpt2, 41, {"group": part + [(1000, 0, MB)]})   # run-1 ids: ignored (in the base)

    tm3 = _tm(first_task_id=9000)
    dp.attach(tm3, "", ckpt2)
    for key, n in _drain(tm3).items():
        seen[key] = seen.get(key, 0) + n
    assert sorted(set(seen.values())) == [2] and len(seen) == 64
    assert [e["records_completed"] for e in tm3.epochs_report()] == [64, 64]


def test_resume_into_the_same_directory_reads_the_table_before_replacing_it(tmp_path):
    ckpt = str(tmp_path / "c")
    tm1 = _tm()
    dp.attach(tm1, ckpt)
    seen = _interrupt(ckpt, tm1, 30)
    tm2 = _tm(first_task_id=5000)
    dp.attach(tm2, ckpt, ckpt)
    base, tasks = dp.read_table(ckpt)
    assert base is not None and base["epochs_created"] == 2
    assert all(t.task_id >= 5000 for t in tasks)
    for key, n in _drain(tm2).items():
        seen[key] = seen.get(key, 0) + n
    assert sorted(set(seen.values())) == [2] and len(seen) == 64
    assert [e["records_completed"] for e in tm2.epochs_report()] == [64, 64]


def test_a_local_checkpoint_resumes_a_distributed_job_and_the_reverse(tmp_path):
    import torch

    from elasticdl.checkpoint import single

    # Local: the task manager's own state, mid-task, written with the model
    local_dir = str(tmp_path / "local")
    tm = _tm()
    seen: dict[tuple[str, int], int] = {}
    for _ in range(5):
        task = tm.get(0)
        for r in range(task.start, task.end):
            seen[(task.shard_name, r)] = seen.get((task.shard_name, r), 0) + 1
        tm.report(task.task_id, 0, True)
    held = tm.get(0)
    for r in range(held.start, held.start + 8):
        seen[(held.shard_name, r)] = seen.get((held.shard_name, r), 0) + 1
    single.save_single(local_dir, 22, {"model": {"w": torch.zeros(1)}, "model_version": 22,
                                       "data_position": tm.state_dict({held.task_id: 8})})
    # ... read by the torch-free master of a distributed job
    resumed = _tm(first_task_id=7000)
    dp.attach(resumed, str(tmp_path / "dist"), local_dir)
    for key, n in _drain(resumed).items():
        seen[key] = seen.get(key, 0) + n
    assert sorted(set(seen.values())) == [2] and len(seen) == 64

    # allreduce: trained records + the table; a Local job's load() gets its position
    ar_dir = str(tmp_path / "ar")
    tm1 = _tm()
    dp.attach(tm1, ar_dir)
    _interrupt(ar_dir, tm1, 30)
    single.save_file({"model": {}, "model_version": 30},
                     os.path.join(version_dir(ar_dir, 30), "model.pt"))
    state = single.load_single(ar_dir)
    assert state["data_position"] == dp.read_position(version_dir(ar_dir, 30))
    assert state["data_position"]["ledger"][1]["records_completed"] == 24


# ------------------------------------------- PS that hold one version differently
class _PS:
    """A PS as far as the data position goes: its applied-identity ledger and how
    often its parameters saw each record (``(task, k)`` applied at most once)."""

    def __init__(self) -> None:
        self.ledger: set[tuple[int, int]] = set()
        self.count: dict[tuple[str, int], int] = {}

    def push(self, task: Task, k: int) -> None:
        if (task.task_id, k) in self.ledger:
            return   # a duplicate: answered, nothing applied
        self.ledger.add((task.task_id, k))
        for r in range(task.start + (k - 1) * MB, min(task.start + k * MB, task.end)):
            self.count[(task.shard_name, r)] = self.count.get((task.shard_name, r), 0) + 1

    def restored(self) -> _PS:
        ps = _PS()
        ps.ledger, ps.count = set(self.ledger), dict(self.count)
        return ps

    def entries(self) -> list[tuple[int, int, int]]:
        return [(t, (k - 1) * MB, MB) for t, k in self.ledger]


def _train(tm: TaskManager, pss: list[_PS], stop_after: int = -1) -> None:
    """Hand out and train tasks, every minibatch pushed to every PS."""
    done = 0
    while done != stop_after:
        task = tm.get(0)
        if task.type != TaskType.TRAINING:
            return
        for k in range(1, (task.end - task.start + MB - 1) // MB + 1):
            for ps in pss:
                ps.push(task, k)
        tm.report(task.task_id, 0, True)
        done += 1


def _parted_checkpoint(tmp_path) -> tuple[str, list[_PS]]:
    """Run 1: an epoch and a half, then a version its two PS wrote holding different
    pushes (PS 0 applied minibatches 1-2 of a task, PS 1 minibatch 1 of it and
    minibatch 1 of another task that PS 0 had not received yet)."""
    ckpt = str(tmp_path / "run1")
    tm = _tm()
    dp.attach(tm, ckpt)
    pss = [_PS(), _PS()]
    _train(tm, pss, stop_after=5)
    a, b = tm.get(0), tm.get(1)
    pss[0].push(a, 1)
    pss[0].push(a, 2)
    pss[1].push(a, 1)
    pss[1].push(b, 1)
    _done(ckpt, 9, {f"ps-{i}-of-2": ps.entries() for i, ps in enumerate(pss)})
    return ckpt, pss


def test_a_task_the_ps_hold_differently_resumes_whole_under_its_own_id(tmp_path):
    ckpt, pss = _parted_checkpoint(tmp_path)
    tm = _tm(first_task_id=5000)
    dp.attach(tm, str(tmp_path / "run2"), ckpt, dp.Carry(num_ps=2, minibatch_size=MB))
    restored = [ps.restored() for ps in pss]   # each PS restores its own shard's ledger
    _train(tm, restored)
    for i, ps in enumerate(restored):
        wrong = {k: v for k, v in ps.count.items() if v != 2}
        assert len(ps.count) == 64 and not wrong, (i, wrong)
    assert [e["records_completed"] for e in tm.epochs_report()] == [64, 64]
    # the tasks resumed under their own ids are in the new run's table: a third run
    # resumed from a checkpoint of the second names their records
    _, tasks = dp.read_table(str(tmp_path / "run2"))
    assert sum(t.task_id < 5000 for t in tasks) == 2


def test_without_the_ledgers_the_minibatches_some_ps_hold_train_again_there(tmp_path, caplog):
    """Another number of PS (or another strategy) cannot restore the ledgers: the
    resume takes what every PS holds and says how much one PS trains twice."""
    ckpt, pss = _parted_checkpoint(tmp_path)
    for carry in (None, dp.Carry(num_ps=3, minibatch_size=MB), dp.Carry(2, 2 * MB)):
        tm = _tm(first_task_id=5000)
        dp.attach(tm, "", ckpt, carry)
        restored = [ps.restored() for ps in pss]
        _train(tm, restored)
        assert max(restored[0].count.values()) == 3 and max(restored[1].count.values()) == 3
        assert min(min(ps.count.values()) for ps in restored) == 2
    assert "trained a second time" in caplog.text


def test_a_run_started_on_a_clock_set_back_takes_ids_above_the_earlier_runs(tmp_path):
    """Task ids are per run (time-based); the restored PS ledgers hold the earlier
    run's. A run whose clock gives it a lower start still hands out new ids above
    every id of the resumed table, so no new task matches an old ledger identity."""
    ckpt, pss = _parted_checkpoint(tmp_path)
    _, old = dp.read_table(ckpt)
    tm = _tm(first_task_id=10)
    dp.attach(tm, str(tmp_path / "run2"), ckpt, dp.Carry(num_ps=2, minibatch_size=MB))
    restored = [ps.restored() for ps in pss]
    old_ids = {t.task_id for t in old}
    seen = []
    while True:
        task = tm.get(0)
        if task.type != TaskType.TRAINING:
            break
        seen.append(task.task_id)
        for k in range(1, (task.end - task.start + MB - 1) // MB + 1):
            for ps in restored:
                ps.push(task, k)
        tm.report(task.task_id, 0, True)
    new = [t for t in seen if t not in old_ids]
    assert new and min(new) > max(old_ids)
    assert all(v == 2 for ps in restored for v in ps.count.values())
