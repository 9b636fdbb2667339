"""The job core's write-ahead journal: a master killed at any point restores to
exactly the state it had acknowledged (snapshot + replayed records), through
the real gRPC servicer too; a record cut short by the kill is dropped, a
damaged one is refused."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from elasticdl.cluster.process import free_port
from elasticdl.common.job_report import JobReport
from elasticdl.common.schedule import Schedule
from elasticdl.common.task import TaskType
from elasticdl.master.job import JobCore
from elasticdl.master.journal import Journal, JournalError
from elasticdl.master.servicer import MasterServicer, start_master_server
from elasticdl.master.task_manager import TaskManager
from elasticdl.worker.master_client import MasterClient
from tests.unit.master.test_job_core import FakeWorker


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        self.t += 0.25
        return self.t


def make_core(clock=None, task_timeout_s=0.0):
    tm = TaskManager([("t", 0, 120)], [("v", 0, 30)], records_per_task=20, num_epochs=2,
                     shuffle=True, seed=3, clock=clock or Clock(),
                     task_timeout_s=task_timeout_s)
    return JobCore(tm, JobReport("j", "Local", "local", 2, 0), Schedule(evaluation_steps=5),
                   minibatch_size=10)


def step(core: JobCore, workers: list[FakeWorker], i: int) -> None:
    w = workers[i % 2]
    if w.held and i % 3:
        w.finish()
    else:
        w.take()


def full_state(core: JobCore) -> dict:
    return {**core.state_dict(), "volatile": core._volatile_state()}


@pytest.mark.parametrize("snapshot_every", [0, 4, 11])
def test_killed_at_any_point_restores_the_acknowledged_state(tmp_path, snapshot_every):
    FakeWorker.shared["version"] = 0
    a = make_core()
    a.attach_journal(Journal(str(tmp_path / "live")))
    a.begin()
    workers = [FakeWorker(a, 0), FakeWorker(a, 1)]
    cuts = 0
    for i in range(400):
        if a.finished():
            break
        step(a, workers, i)
        if snapshot_every and i % snapshot_every == 0:
            a.snapshot()
        if i % 5 == 0 or i < 6:  # "kill -9" here: what is on disk is all there is
            copy = tmp_path / f"cut{i}"
            shutil.copytree(tmp_path / "live", copy)
            b = make_core(clock=Clock())
            b.restore(Journal(str(copy)))
            assert full_state(b) == full_state(a), f"cut after step {i}"
            cuts += 1
    assert a.finished() and cuts > 10
    assert [e["records_completed"] for e in a.tm.epochs_report()] == [120, 120]
    if snapshot_every:  # old segments go once a snapshot covers them
        assert len([n for n in os.listdir(tmp_path / "live") if n.startswith("journal-")]) <= 2


def test_restored_core_goes_on_like_the_one_that_died(tmp_path):
    FakeWorker.shared["version"] = 0
    clock_a, clock_b = Clock(), Clock()
    a = make_core(clock=clock_a)
    a.attach_journal(Journal(str(tmp_path / "j")))
    wa = [FakeWorker(a, 0), FakeWorker(a, 1)]
    for i in range(23):
        step(a, wa, i)
        if i == 9:
            a.snapshot()
    model = FakeWorker.shared["version"]
    clock_b.t = clock_a.t  # the restarted master's clock goes on from the same time
    b = make_core(clock=clock_b)
    n = b.restore(Journal(str(tmp_path / "j")))
    assert n > 0
    wb = [FakeWorker(b, 0), FakeWorker(b, 1)]
    for x, y in zip(wa, wb):
        y.held = list(x.held)
    # the dead master's last acknowledged task result, reported again after the
    # restart (the worker never saw the reply): counted once
    done = [e["records_completed"] for e in b.tm.epochs_report()]
    seen_a, seen_b = [], []
    for core, ws, seen in ((a, wa, seen_a), (b, wb, seen_b)):
        FakeWorker.shared["version"] = model
        for i in range(23, 600):
            if core.finished():
                break
            step(core, ws, i)
            seen.append(core.state_dict()["tasks"]["completed"][-3:])
    assert seen_a == seen_b
    sa, sb = a.state_dict(), b.state_dict()
    for s in (sa, sb):  # task durations: the test clock ticks per reading, the restore reads it
        s["tasks"].pop("durations")
    assert sa == sb
    assert done[0] > 0 and [e["records_completed"] for e in b.tm.epochs_report()] == [120, 120]


def test_a_result_reported_twice_across_a_restart_counts_once(tmp_path):
    a = make_core()
    a.attach_journal(Journal(str(tmp_path / "j")))
    t = a.get(0)
    a.report_task(t.task_id, 0, True, model_version=1)
    b = make_core(clock=Clock())
    b.restore(Journal(str(tmp_path / "j")))
    b.report_task(t.task_id, 0, True, model_version=1)  # the retry after reconnect
    assert b.tm.epochs_report()[0]["records_completed"] == 20
    assert b.tm.ledger[0].tasks_completed == 1


def test_record_cut_short_is_dropped_damaged_record_is_refused(tmp_path):
    d = tmp_path / "j"
    a = make_core()
    a.attach_journal(Journal(str(d)))
    t1 = a.get(0)
    before = full_state(a)
    a.get(1)
    seg = sorted(p for p in os.listdir(d) if p.startswith("journal-"))[-1]
    with open(d / seg, "rb+") as f:  # the last record cut in the middle by the kill
        data = f.read()
        f.truncate(len(data) - 9)
    b = make_core(clock=Clock())
    b.restore(Journal(str(d)))
    assert full_state(b) == before
    # the restored master journals on after the torn record, and restores again
    b.report_task(t1.task_id, 0, True, model_version=1)
    c = make_core(clock=Clock())
    c.restore(Journal(str(d)))
    assert full_state(c) == full_state(b)
    lines = (d / seg).read_text().split("\n")
    lines[0] = lines[0][:5] + "#" + lines[0][6:]  # "seq" loses its closing quote
    (d / seg).write_text("\n".join(lines))
    with pytest.raises(JournalError, match="damaged record"):
        Journal(str(d))


def test_replay_that_decides_differently_is_refused(tmp_path):
    a = make_core()
    a.attach_journal(Journal(str(tmp_path / "j")))
    a.get(0)
    other = TaskManager([("t", 0, 120)], records_per_task=30, clock=Clock())
    b = JobCore(other, JobReport("j", "Local", "local", 2, 0))
    with pytest.raises(JournalError, match="replayed get_task"):
        b.restore(Journal(str(tmp_path / "j")))


def test_every_grpc_call_is_journaled_before_its_reply(tmp_path):
    core = make_core(clock=lambda: 5.0)
    core.attach_journal(Journal(str(tmp_path / "j")))
    port = free_port()
    server = start_master_server(MasterServicer(core), port, host="127.0.0.1")
    client = MasterClient(f"127.0.0.1:{port}", 0)
    try:
        task = client.get_task()
        assert task.type == TaskType.TRAINING
        # the reply came: a master killed now restores with the task handed out
        b = make_core(clock=lambda: 5.0)
        b.restore(Journal(str(tmp_path / "j")))
        assert full_state(b) == full_state(core)
        client.version = lambda: 2
        client.report_task(task)
        b = make_core(clock=lambda: 5.0)
        b.restore(Journal(str(tmp_path / "j")))
        assert b.tm.epochs_report()[0]["records_completed"] == 20
        assert full_state(b) == full_state(core)
    finally:
        client.close()
        server.stop(0)


def test_rendezvous_plan_survives_a_master_restart():
    """Allreduce members keep training on the plan the dead master published."""
    from tests.unit.master.test_rendezvous import FakeClock, make

    clock = FakeClock()
    a = make(clock, initial_workers=2)
    a.join(0, "h0", 1)
    a.join(1, "h1", 2)
    clock.advance(2)
    plan = a.get_comm_plan(0, 0)
    assert plan.ready and plan.world_size == 2
    b = make(FakeClock(), initial_workers=2)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for w in (0, 1):
        assert b.get_comm_plan(w, plan.plan_version) == a.get_comm_plan(w, plan.plan_version)
    b.remove_worker(1)  # and it goes on from there: a new plan, a newer version
    clock_b = b._clock
    clock_b.advance(40)
    assert b.get_comm_plan(0, plan.plan_version).plan_version == plan.plan_version + 1


def test_leases_and_batched_reports_restore_at_any_cut(tmp_path):
    """get_tasks and report_tasks journal one record per call (not one per task); a
    master killed after any call restores to the live state, including a batch in
    which one result is refused (a version from the future: nothing recorded for it)
    and leases that run into an epoch's end (WAIT) and stragglers reassigned."""
    from elasticdl.master.job import TaskResult, VersionError

    clock = Clock()
    a = make_core(clock=clock, task_timeout_s=3.0)
    journal = Journal(str(tmp_path / "live"))
    a.attach_journal(journal)
    a.begin()
    held: dict[int, list] = {0: [], 1: [], 2: []}
    version, calls, refused_seen, batches = 0, 0, 0, 0
    for i in range(200):
        if a.finished():
            break
        w = i % 3
        results = []
        for t in held[w]:
            version += 1
            results.append(TaskResult(t.task_id, True, model_version=version, loss=0.5,
                                      learning_rate=0.1))
        bad = bool(results) and batches % 3 == 0
        batches += bool(results)
        if bad:   # a version far ahead of any the job made: refused
            results.append(TaskResult(results[0].task_id, True, model_version=10**6))
        seq0 = journal.seq
        refused = a.report_tasks(w, results) if results else []
        assert [r.position for r in refused] == ([len(results) - 1] if bad else [])
        refused_seen += len(refused)
        if refused:
            assert "ahead" in refused[0].reason and refused[0].invalid
        got = a.get_tasks(w, None, 3)
        # worker 2 never reports evaluation tasks: stragglers, reassigned after 3 s
        held[w] = [t for t in got if t.type == TaskType.TRAINING or
                   t.type == TaskType.EVALUATION and w != 2]
        assert journal.seq - seq0 == (1 if results and len(refused) < len(results) else 0) + 1
        calls += 1
        copy = tmp_path / f"cut{i}"
        shutil.copytree(tmp_path / "live", copy)
        b = make_core(clock=Clock(), task_timeout_s=3.0)
        b.restore(Journal(str(copy)))
        assert full_state(b) == full_state(a), f"cut after call {i}"
        shutil.rmtree(copy)
    assert a.finished() and calls > 20
    assert refused_seen == -(-batches // 3) >= 2
    assert [e["records_completed"] for e in a.tm.epochs_report()] == [120, 120]
    with pytest.raises(VersionError):   # the single-report path refuses alike
        a.report_task(a.get(0).task_id, 0, True, model_version=10**6)
    # a task another worker holds, and an id never handed out: refused, nothing recorded
    c = make_core()
    other = Journal(str(tmp_path / "other"))
    c.attach_journal(other)
    held_by_0 = c.get(0)
    seq0 = other.seq
    refused = c.report_tasks(1, [TaskResult(held_by_0.task_id, True),
                                 TaskResult(10**9, True)])
    assert [(r.position, r.invalid) for r in refused] == [(0, False), (1, True)]
    assert "does not hold" in refused[0].reason and "unknown task_id" in refused[1].reason
    assert other.seq == seq0 and c.held_task(held_by_0.task_id)[1] == {0}
