"""Task leases and batched reports over the real gRPC master (in-process server
on 127.0.0.1, journal on disk): leased tasks are held like single ones, a dead
worker's lease is re-queued and done exactly once, a lost lease reply is handed
back (also by a restored master), batched results are journaled before the
reply, refusals leave the rest of a batch applied; and the worker's lease
buffer (size adapting to the task duration, results sent with the next call)."""

from __future__ import annotations

import os
import shutil
from collections import Counter

import pytest

from elasticdl.cluster.process import free_port
from elasticdl.common.task import Task, TaskType
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.job import JobCore
from elasticdl.master.journal import Journal
from elasticdl.master.servicer import MasterServicer, start_master_server
from elasticdl.master.task_manager import TaskManager
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.worker.master_client import MasterClient, ReportRefused
from elasticdl.worker.poller import LeasedTasks

RECORDS, PER_TASK = 200, 10


def make_core() -> JobCore:
    tm = TaskManager([("t", 0, RECORDS)], records_per_task=PER_TASK)
    return JobCore.for_tasks(tm, EvaluationAggregator())


class Master:
    def __init__(self, journal_dir: str, restore: bool = False):
        self.core = make_core()
        journal = Journal(journal_dir)
        if restore:
            self.core.restore(journal)
        else:
            self.core.attach_journal(journal)
        self.servicer = MasterServicer(self.core)
        self.port = free_port()
        self.server = start_master_server(self.servicer, self.port, host="127.0.0.1")
        self.addr = f"127.0.0.1:{self.port}"

    def client(self, worker_id: int) -> MasterClient:
        return MasterClient(self.addr, worker_id, call_timeout_s=10, unavailable_timeout_s=10)

    def stop(self) -> None:
        self.server.stop(0)


@pytest.fixture
def master(tmp_path):
    m = Master(str(tmp_path / "journal"))
    yield m
    m.stop()


def held_by(core: JobCore, task_id: int) -> frozenset[int]:
    return core.held_task(task_id)[1]


def done_records(core: JobCore) -> int:
    return sum(e["records_completed"] for e in core.tm.epochs_report())


def test_a_lease_is_several_held_tasks_and_a_dead_workers_lease_is_redone_once(master):
    c0, c1 = master.client(0), master.client(1)
    lease = c0.get_tasks(None, 5)
    assert len(lease) == 5 and len({t.task_id for t in lease}) == 5
    assert all(t.type == TaskType.TRAINING for t in lease)
    assert all(held_by(master.core, t.task_id) == {0} for t in lease)
    # worker 0 finishes one task (result kept for its next call) and dies
    lost = master.core.recover_tasks(0)
    assert sorted(t.task_id for t in lost) == sorted(t.task_id for t in lease)
    done: Counter[int] = Counter()
    reports: list[pb.ReportTaskResultRequest] = []
    while True:
        tasks = c1.get_tasks(None, 4, reports)
        if tasks[0].type == TaskType.NONE:
            break
        assert tasks[0].type == TaskType.TRAINING, tasks
        done.update(t.task_id for t in tasks)
        reports = [c1.report_request(t, counters={"records_applied": t.num_records})
                   for t in tasks]
    assert max(done.values()) == 1 and len(done) == RECORDS // PER_TASK
    assert {t.task_id for t in lease} <= set(done)
    epoch = master.core.tm.epochs_report()[0]
    assert epoch["records_completed"] == epoch["records_applied"] == RECORDS
    assert epoch["records_redone"] == 5 * PER_TASK   # the lease, re-queued
    c0.close()
    c1.close()


def test_a_lost_lease_reply_is_handed_back_also_by_a_restored_master(tmp_path):
    journal = str(tmp_path / "journal")
    m = Master(journal)
    c = m.client(3)
    first = [t.task_id for t in c.get_tasks(None, 4)]
    # the reply was lost: the worker asks again, holding nothing it knows of
    assert [t.task_id for t in c.get_tasks(None, 4)] == first
    c.close()
    m.stop()
    # the master dies; a restored one has no memory of leases, only the journal
    m2 = Master(journal, restore=True)
    c = m2.client(3)
    assert sorted(t.task_id for t in c.get_tasks(None, 4)) == sorted(first)
    again = [c.report_request(Task(i, TaskType.TRAINING, "t", 0, PER_TASK)) for i in first]
    fresh = c.get_tasks(None, 4, again)
    assert fresh[0].type == TaskType.TRAINING and not set(first) & {t.task_id for t in fresh}
    assert done_records(m2.core) == 4 * PER_TASK
    c.close()
    m2.stop()


def test_batched_results_are_journaled_before_the_reply(master, tmp_path):
    c = master.client(0)
    tasks = c.get_tasks(None, 6)
    c.report_tasks([c.report_request(t, loss=0.5, learning_rate=0.1) for t in tasks[:3]])
    more = c.get_tasks(None, 2, [c.report_request(t) for t in tasks[3:]])
    # copy the journal now, as a kill -9 would leave it: every acknowledged result is in
    copy = str(tmp_path / "copy")
    shutil.copytree(master.core._journal.directory, copy)
    restored = make_core()
    restored.restore(Journal(copy))
    assert done_records(restored) == 6 * PER_TASK
    assert all(held_by(restored, t.task_id) == {0} for t in more)
    assert os.path.exists(copy)
    c.close()


def test_a_refused_result_leaves_the_rest_of_its_batch_applied(master):
    c0, c1 = master.client(0), master.client(1)
    mine = c0.get_tasks(None, 2)
    theirs = c1.get_tasks(None, 1)
    bad = c0.report_request(theirs[0])
    with pytest.raises(ReportRefused, match=f"task {theirs[0].task_id}: denied"):
        c0.report_tasks([c0.report_request(mine[0]), bad, c0.report_request(mine[1])])
    assert done_records(master.core) == 2 * PER_TASK
    assert held_by(master.core, theirs[0].task_id) == {1}
    with pytest.raises(ReportRefused, match="invalid"):   # an unknown task id
        c0.report_tasks([c0.report_request(Task(10**6, TaskType.TRAINING, "t", 0, 1))])
    c0.close()
    c1.close()


def test_lease_size_is_bounded_by_the_request_and_a_fair_share(master):
    import grpc

    c = master.client(0)
    with pytest.raises(grpc.RpcError, match="max_tasks"):
        c.get_tasks(None, 0)
    with pytest.raises(grpc.RpcError, match="max_tasks"):
        c.get_tasks(None, 65)
    others = [master.client(w) for w in (1, 2, 3)]
    for o in others:
        o.get_tasks(None, 1)
    # 20 tasks, 3 out: 17 queued over the 4 workers known -> at most 5 per lease
    lease = c.get_tasks(None, 64)
    assert len(lease) == 5
    for o in others + [c]:
        o.close()


class FakeLeasing:
    """A source that leases (as MasterClient), recording every call."""

    def __init__(self, tasks: int):
        self.queue = [Task(i, TaskType.TRAINING, "s", 0, 1) for i in range(tasks)]
        self.calls: list[tuple] = []

    def report_request(self, task, error="", traceback="", fatal=False, counters=None,
                       loss=None, learning_rate=None):
        return (task.task_id, error)

    def get_tasks(self, task_type, max_tasks, reports=()):
        self.calls.append(("get", max_tasks, list(reports)))
        if not self.queue:
            return [Task(-1, TaskType.NONE, "", 0, 0)]
        out, self.queue = self.queue[:max_tasks], self.queue[max_tasks:]
        return out

    def report_tasks(self, reports):
        self.calls.append(("report", list(reports)))


def test_lease_buffer_adapts_to_task_duration_and_sends_results_with_the_next_call():
    now = [0.0]
    src = FakeLeasing(40)
    leased = LeasedTasks(src, lease_s=1.0, max_lease=8, clock=lambda: now[0])
    seen = []
    while (task := leased.get_task()).type != TaskType.NONE:
        seen.append(task.task_id)
        now[0] += 0.1            # each task takes 0.1 s
        leased.report_task(task)
    assert seen == list(range(40))
    sizes = [c[1] for c in src.calls if c[0] == "get"]
    assert sizes[0] == 1 and max(sizes) == 8   # 1 s of 0.1 s tasks, capped at 8
    # every result went with the following get_tasks call, none on its own
    sent = [r for c in src.calls if c[0] == "get" for r in c[2]]
    assert sent == [(i, "") for i in range(40)]
    assert not any(c[0] == "report" for c in src.calls)


def test_lease_buffer_sends_a_failure_and_old_results_at_once():
    now = [0.0]
    src = FakeLeasing(20)
    leased = LeasedTasks(src, lease_s=1.0, max_lease=4, clock=lambda: now[0])
    a = leased.get_task()
    now[0] += 0.2
    leased.report_task(a)
    b = leased.get_task()         # lease of 4 (1 s / 0.2 s = 5, capped)
    assert leased.leased == 3
    leased.report_task(b, error="boom")
    assert src.calls[-1] == ("report", [(b.task_id, "boom")])
    c = leased.get_task()
    leased.report_task(c)
    now[0] += 1.5                 # a result older than lease_s goes on its own
    d = leased.get_task()
    assert src.calls[-1] == ("report", [(c.task_id, "")])
    leased.report_task(d)
    leased.flush()
    assert src.calls[-1] == ("report", [(d.task_id, "")])
    # tasks of lease_s or longer go one per call
    slow = LeasedTasks(FakeLeasing(5), lease_s=1.0, clock=lambda: now[0])
    for _ in range(3):
        t = slow.get_task()
        now[0] += 2.0
        slow.report_task(t)
    assert slow.lease_size() == 1


def test_straggler_check_is_skipped_only_while_nothing_can_be_overdue():
    """get looks only at the front of the held tasks (the oldest hand-outs); with
    leases out (thousands held) it decides exactly as a scan of every held task
    on every get (compared step by step), also after a restore."""
    import random

    from elasticdl.master import task_state

    rng = random.Random(7)
    now = [0.0]

    def make() -> TaskManager:
        return TaskManager([("t", 0, 400)], records_per_task=1, task_timeout_s=5.0,
                           clock=lambda: now[0])

    def scan_always(tm: TaskManager) -> TaskManager:
        """The reference: every held task looked at on every get."""
        def scan() -> None:
            timeout, now_ = tm.timeouts.timeout(), tm._clock()
            for doing in list(tm._doing.values()):
                if doing.worker_id >= 0 and now_ - doing.started > timeout:
                    doing.worker_id = -1 - doing.worker_id
                    tm._requeue(doing.task)
        tm._reassign_stragglers = scan  # type: ignore[method-assign]
        return tm

    fast, full = make(), scan_always(make())
    held: list[tuple[int, int]] = []
    reassigned = 0
    for step in range(800):
        now[0] += rng.random() * 0.6
        if rng.random() < 0.5 or not held:
            w = rng.randrange(5)
            a, b = fast.get(w), full.get(w)
            assert a == b, step
            if a.type == TaskType.TRAINING:
                held.append((a.task_id, w))
        else:
            task_id, w = held.pop(rng.randrange(len(held)))
            fast.report(task_id, w, True)
            full.report(task_id, w, True)
        assert {k: d.worker_id for k, d in fast._doing.items()} == \
            {k: d.worker_id for k, d in full._doing.items()}, step
        reassigned = max(reassigned, sum(d.worker_id < 0 for d in fast._doing.values()))
        if step == 400:   # both restored (the same state, held tasks started 4 s ago)
            state = task_state.dump(fast)
            fast, full = make(), scan_always(make())
            task_state.restore(fast, state, now[0] - 4.0)
            task_state.restore(full, state, now[0] - 4.0)
    assert reassigned > 0   # stragglers were found, by both
