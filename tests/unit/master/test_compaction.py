"""The master's bookkeeping is sized by the live state (issue 20, docs/scale.md):
finished work is intervals and counters, per-task detail lives only until a
checkpoint settles it, and compaction keeps rollback, resume and master restore
exact. "Exact" is checked on a simulated model: a per-(epoch, record) counter a
PS would hold, checkpointed and rolled back with the closed set its ledgers
would carry, which must end with every record trained once per epoch."""

from __future__ import annotations

import json
import os
import random

import pytest

from elasticdl.checkpoint import data_position as dp
from elasticdl.checkpoint.paths import version_dir
from elasticdl.common.intervals import IntervalSet
from elasticdl.common.job_report import JobReport
from elasticdl.common.task import TaskType
from elasticdl.common.task_blocks import Permutation
from elasticdl.master import task_state
from elasticdl.master.job import JobCore
from elasticdl.master.job_factory import core_from_spec
from elasticdl.master.journal import Journal
from elasticdl.master.task_manager import TaskManager

RECORDS, RPT, EPOCHS = 640, 8, 3


def make_tm(**kw) -> TaskManager:
    return TaskManager([("a", 0, RECORDS // 2), ("b", 0, RECORDS // 2)], records_per_task=RPT,
                       num_epochs=kw.pop("num_epochs", EPOCHS), shuffle=True, seed=11,
                       first_task_id=kw.pop("first_task_id", 1000), **kw)


class Model:
    """What a PS holds: how often each (epoch, shard, record) was applied, and the
    ids of the tasks whose records it holds whole (its closed set)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, str, int], int] = {}
        self.closed = IntervalSet()

    def train(self, task) -> None:
        for r in range(task.start, task.end):
            key = (task.epoch, task.shard_name, r)
            self.counts[key] = self.counts.get(key, 0) + 1

    def copy(self) -> Model:
        m = Model()
        m.counts, m.closed = dict(self.counts), self.closed.copy()
        return m

    def exactly_once(self, epochs: int = EPOCHS) -> bool:
        return len(self.counts) == epochs * RECORDS and set(self.counts.values()) == {1}


def test_permutation_is_a_seeded_bijection():
    for n in (1, 2, 3, 5, 64, 1000, 4097):
        p = Permutation(n, 7)
        assert sorted(p(i) for i in range(n)) == list(range(n))
    a = [Permutation(1000, 1)(i) for i in range(1000)]
    assert a == [Permutation(1000, 1)(i) for i in range(1000)]
    assert a != [Permutation(1000, 2)(i) for i in range(1000)] and a != sorted(a)
    with pytest.raises(IndexError):
        Permutation(10, 1)(10)


def run_some(core: JobCore, model: Model, n: int, rng: random.Random, held: dict) -> None:
    """``n`` task reports from 8 workers in random order (holes in the closed set)."""
    for w in range(8):
        if w not in held:
            t = core.get(w)
            if t.type == TaskType.TRAINING:
                held[w] = t
    for _ in range(n):
        if not held:
            return
        w = rng.choice(sorted(held))
        task = held.pop(w)
        model.train(task)
        core.report_task(task.task_id, w, True)
        model.closed.add(task.task_id)
        t = core.get(w)
        if t.type == TaskType.TRAINING:
            held[w] = t


def test_state_size_does_not_grow_with_tasks_done():
    sizes = {}
    for done in (200, 2000):
        tm = TaskManager([("a", 0, 64 * 4000)], records_per_task=64, num_epochs=1,
                         shuffle=True, seed=1)
        core = JobCore.for_tasks(tm)
        model, held, rng = Model(), {}, random.Random(0)
        for k in range(done // 100):
            run_some(core, model, 100, rng, held)
            core.settle(k, core.closed_tasks()[1])   # a checkpoint holds what is closed
        assert tm.unsettled() == 0 and len(tm.completed) == done
        assert tm.completed.num_intervals <= 9        # at most one hole per worker
        sizes[done] = len(json.dumps(core.state_dict()))
    assert sizes[2000] < 1.2 * sizes[200], sizes


class _Reader:
    def create_shards(self):
        return [("a", 0, 64)]


@pytest.mark.parametrize("flags,settles", [
    ({"distribution_strategy": "ParameterServerStrategy", "checkpoint_dir": "c"}, False),
    ({"distribution_strategy": "ParameterServerStrategy"}, True),
    ({"distribution_strategy": "AllreduceStrategy", "checkpoint_dir": "c"}, True),
])
def test_settle_on_close_where_no_rollback_can_happen(flags, settles):
    from elasticdl.common.job_spec import job_spec_from_flags

    spec = job_spec_from_flags("train", {"model_zoo": "z", "model_def": "m.f",
                                         "training_data": "d", **flags})
    core = core_from_spec(spec, {TaskType.TRAINING: _Reader()})
    assert core.tm.settle_on_close == settles
    t = core.get(0)
    core.report_task(t.task_id, 0, True)
    assert core.tm.unsettled() == (0 if settles else 1) and t.task_id in core.tm.completed


def test_rollback_after_settle_requeues_exactly_what_the_checkpoint_lacks():
    """Checkpoint A (settled by checkpoint B later), checkpoint B, more work, a PS
    rollback to B: only the unsettled work after B is redone; every record once."""
    core = JobCore.for_tasks(make_tm())
    model, held, rng = Model(), {}, random.Random(3)
    run_some(core, model, 30, rng, held)
    ckpt_a = model.copy()
    run_some(core, model, 30, rng, held)
    ckpt_b = model.copy()
    assert core.settle(1, ckpt_a.closed) == len(ckpt_a.closed)   # B completes: A settles
    unsettled_before = core.tm.unsettled()
    run_some(core, model, 25, rng, held)
    # the PS rolls back to B: the model is B's, its closed set B's; held tasks' pushes
    # after B are gone too (their holders re-report them; here they are recovered)
    model = ckpt_b.copy()
    for w in list(held):
        core.recover_tasks(w)
    held.clear()
    core.begin_rollback()
    lost = core.rollback({}, 10_000, closed=model.closed)
    assert lost and not set(lost) & set(model.closed.members())
    assert unsettled_before <= core.tm.unsettled() + len(lost)
    while not core.finished():
        before = len(model.counts), sum(model.counts.values())
        run_some(core, model, 50, rng, held)
        assert (len(model.counts), sum(model.counts.values())) != before or core.finished()
    assert model.exactly_once()
    assert [e["records_completed"] for e in core.tm.epochs_report()] == [RECORDS] * EPOCHS


def test_rollback_counts_partial_tasks_from_applied_and_closed_from_the_set():
    core = JobCore.for_tasks(make_tm(num_epochs=1))
    a, b, c = core.get(0), core.get(1), core.get(2)
    for w, t in enumerate((a, b, c)):
        core.report_task(t.task_id, w, True)
    # the checkpoint holds a whole (closed), b half (its ledger), c not at all
    lost = core.rollback({b.task_id: 4}, 500, closed=IntervalSet([(a.task_id, a.task_id + 1)]))
    assert sorted(lost) == sorted([b.task_id, c.task_id])
    led = core.tm.ledger[0]
    assert led.records_completed == a.num_records and led.records_redone == (8 - 4) + 8


def test_master_restore_across_settle_and_rollback_is_exact(tmp_path):
    """The journal replays settle and rollback(closed): a master killed after them
    restores the same state and the job ends with every record once."""
    live = JobCore.for_tasks(make_tm())
    live.attach_journal(Journal(str(tmp_path / "j"), fsync=False))
    model, held, rng = Model(), {}, random.Random(5)
    run_some(live, model, 40, rng, held)
    ckpt = model.copy()
    live.snapshot()
    run_some(live, model, 20, rng, held)
    live.settle(0, ckpt.closed)
    run_some(live, model, 20, rng, held)
    model = ckpt.copy()
    for w in list(held):
        live.recover_tasks(w)
    held.clear()
    live.rollback({}, 9000, closed=ckpt.closed)
    run_some(live, model, 10, rng, held)
    # the master dies; a new one restores from the journal (snapshot + records)
    restored = JobCore.for_tasks(make_tm())
    assert restored.restore(Journal(str(tmp_path / "j"), fsync=False)) > 0
    assert task_state.dump(restored.tm) == task_state.dump(live.tm)
    assert restored.tm.unsettled() == live.tm.unsettled() > 0
    while not restored.finished():
        run_some(restored, model, 50, rng, held)
    assert model.exactly_once()


def test_task_table_has_a_line_per_epoch_and_resumes_from_compact_trained_files(tmp_path):
    ckpt = str(tmp_path / "c")
    tm = make_tm()
    dp.attach(tm, ckpt)
    core = JobCore.for_tasks(tm)
    model, held, rng = Model(), {}, random.Random(9)
    run_some(core, model, 100, rng, held)     # into epoch 1 (80 tasks per epoch)
    # a checkpoint: the PS writers' compact files (closed + a held task's minibatches)
    part = next(iter(held.values()))
    vdir = version_dir(ckpt, 7)
    os.makedirs(vdir)
    for writer in ("ps-0-of-2", "ps-1-of-2"):
        dp.write_trained_compact(vdir, writer, -1, model.closed,
                                 [(part.task_id, 0, 4)])
    open(os.path.join(vdir, "DONE"), "w").close()
    lines = open(os.path.join(ckpt, dp.TABLE)).read().splitlines()
    assert len(lines) == 1 + 2, lines           # pieces + one line per epoch created
    model.train(type(part)(part.task_id, part.type, part.shard_name, part.start,
                           part.start + 4, part.epoch))
    # resume: a new run from that checkpoint trains the rest, each record once
    tm2 = make_tm(first_task_id=50_000)
    dp.attach(tm2, str(tmp_path / "c2"), ckpt)
    core2 = JobCore.for_tasks(tm2)
    held2: dict = {}
    while not core2.finished():
        run_some(core2, model, 50, rng, held2)
    assert model.exactly_once()
    assert [e["records_completed"] for e in tm2.epochs_report()] == [RECORDS] * EPOCHS


def test_compact_and_list_trained_files_combine_per_writer(tmp_path):
    vdir = str(tmp_path / "v")
    dp.write_trained_compact(vdir, "ps-0", 3, IntervalSet([(10, 20)]), [(25, 0, 4)])
    dp.write_trained(vdir, "ps-1", [(12, 0, 4), (25, 0, 4), (25, 4, 4)])
    found = dp.read_trained_set(vdir)
    # 10..19 whole on ps-0 only: on ps-1 just task 12's first minibatch
    assert found.closed == IntervalSet() and found.entries == {12: {0: 4}, 25: {0: 4}}
    dp.write_trained_compact(vdir, "ps-1", 3, IntervalSet([(10, 15)]), [(17, 0, 4)])
    found = dp.read_trained_set(vdir)
    assert found.closed == IntervalSet([(10, 15)]) and found.entries == {17: {0: 4}}


def test_learning_rates_are_a_bounded_summary():
    report = JobReport("j", "Local", "local", 1, 0)
    for k in range(10_000):
        report.add_training(0, 8, 0.5, 0.1 * 0.999 ** k)
    report.add_training(1, 8, 0.5, 0.07)
    summary = report.training_summary()
    e0 = summary[0]["learning_rate"]
    assert e0["first"] == 0.1 and e0["count"] == 10_000 and e0["last"] == e0["min"] < 0.1
    assert summary[0]["learning_rates"] == [e0["min"], e0["max"]]
    assert summary[1]["learning_rates"] == [0.07]     # a per-epoch schedule: one value
    assert len(json.dumps(report.state_dict())) < 600


def test_resumed_pending_ranges_leave_the_state_as_they_go_out():
    pending = [["a", i * 4, i * 4 + 3, 0] for i in range(10_000)]   # not derivable
    tm = TaskManager([("a", 0, 40_000)], records_per_task=4, num_epochs=2, first_task_id=7,
                     settle_on_close=True)
    tm.load_state_dict({"epochs_created": 1, "pending": pending,
                        "ledger": {0: {"records_completed": 10_000, "records_redone": 0,
                                       "tasks_completed": 0}}})
    full = len(json.dumps(task_state.dump(tm)))
    for _ in range(8000):
        t = tm.get(0)
        tm.report(t.task_id, 0, True)
    state = task_state.dump(tm)
    assert len(json.dumps(state)) < 0.3 * full
    again = TaskManager([("a", 0, 40_000)], records_per_task=4, num_epochs=2, first_task_id=7,
                        settle_on_close=True)
    task_state.restore(again, json.loads(json.dumps(state)), 0.0)
    rest_a = [tm.get(1) for _ in range(2000)]
    rest_b = [again.get(1) for _ in range(2000)]
    assert rest_a == rest_b and rest_a[-1].start == 39_996 and rest_a[-1].epoch == 0
