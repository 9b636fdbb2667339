"""The job core: evaluations as a barrier labelled with the version evaluated,
validated versions (also through the real gRPC servicer), and its state round
trip through JSON."""

from __future__ import annotations

import json

import grpc
import pytest

from elasticdl.cluster.process import free_port
from elasticdl.common.enums import JobType
from elasticdl.common.job_report import JobReport
from elasticdl.common.schedule import Schedule
from elasticdl.common.task import Task, TaskType
from elasticdl.master.job import JobCore, VersionError
from elasticdl.master.servicer import MasterServicer, start_master_server
from elasticdl.master.task_manager import TaskManager
from elasticdl.worker.master_client import MasterClient


def make_core(evaluation_steps=0, epochs=2, train=120, val=30, shuffle=False, **kw):
    tm = TaskManager([("t", 0, train)], [("v", 0, val)], records_per_task=20,
                     num_epochs=epochs, shuffle=shuffle, seed=3)
    return JobCore(tm, JobReport("j", "Local", "local", 2, 0),
                   Schedule(evaluation_steps=evaluation_steps), minibatch_size=10, **kw)


class FakeWorker:
    """A worker whose model is a counter: each minibatch trained is one version
    (as with Local/allreduce); evaluating records the version it saw and reports
    it as the metric, so a label can be checked against what was evaluated."""

    shared = {"version": 0}  # one model (allreduce members / a PS), reset per test

    def __init__(self, core: JobCore, worker_id: int):
        self.core, self.worker_id = core, worker_id
        self.held: list[Task] = []

    def take(self) -> Task:
        task = self.core.get(self.worker_id)
        if task.type in (TaskType.TRAINING, TaskType.EVALUATION):
            self.held.append(task)
        return task

    def finish(self, progress_reports: bool = False) -> Task:
        """Run the oldest held task and report it with the version after it (as
        every worker does); ``progress_reports``: also report each minibatch's
        version on the way (frequent), else nothing between results (rare)."""
        task = self.held.pop(0)
        if task.type == TaskType.TRAINING:
            for _ in range(-(-task.num_records // 10)):
                self.shared["version"] += 1
                if progress_reports:
                    self.core.on_version(self.worker_id, self.shared["version"])
        else:
            seen = float(self.shared["version"])
            self.core.report_evaluation(task.task_id, task.model_version,
                                        [("seen_version", seen, task.num_records)])
        self.core.report_task(task.task_id, self.worker_id, True,
                              model_version=self.shared["version"])
        return task


def drive(core: JobCore, workers: list[FakeWorker], progress_reports=False,
          limit=10_000) -> None:
    """Round-robin: every worker takes one task, then every worker finishes one."""
    for _ in range(limit):
        if core.finished():
            return
        for w in workers:
            w.take()
        for w in workers:
            if w.held:
                w.finish(progress_reports)
    raise AssertionError("job did not finish")


@pytest.mark.parametrize("evaluation_steps,rare", [(0, True), (7, False), (7, True)])
def test_epoch_end_and_final_evaluations_once_each_labelled_with_the_version_seen(
        evaluation_steps, rare):
    FakeWorker.shared["version"] = 0
    core = make_core(evaluation_steps)
    workers = [FakeWorker(core, 0), FakeWorker(core, 1)]
    # rare: versions come only with task results (each task is 2 minibatches and
    # the two workers interleave); else also after every minibatch
    drive(core, workers, progress_reports=not rare)
    evals = core.report.evaluations
    assert [e["epoch"] for e in evals if "epoch_end" in e["reasons"]] == [0, 1], evals
    finals = [e for e in evals if "final" in e["reasons"]]
    assert len(finals) == 1 and finals[0] is evals[-1]
    for e in evals:  # the label is the version every evaluation task saw
        assert e["metrics"]["seen_version"] == e["model_version"], e
    assert [e["model_version"] for e in evals] == sorted({e["model_version"] for e in evals})
    assert finals[0]["model_version"] == FakeWorker.shared["version"] == 24
    assert any("periodic" in e["reasons"] for e in evals) == bool(evaluation_steps)
    assert core.report.final_metrics == finals[0]["metrics"]
    assert [e["records_completed"] for e in core.tm.epochs_report()] == [120, 120]


def test_periodic_and_epoch_end_on_one_version_run_once_with_both_reasons():
    FakeWorker.shared["version"] = 0
    core = make_core(evaluation_steps=12, epochs=1)  # 6 tasks x 2 minibatches: 12 versions
    w = FakeWorker(core, 0)
    drive(core, [w], progress_reports=True)
    assert [(e["model_version"], e["reasons"]) for e in core.report.evaluations] == \
        [(12, ["periodic", "epoch_end", "final"])]


def test_future_versions_rejected_stale_ones_never_move_back():
    core = make_core()
    with pytest.raises(VersionError):
        core.on_version(0, 1)  # nothing handed out yet
    task = core.get(0)
    assert core.version_bound() == 2  # 20 records, minibatches of 10
    core.on_version(0, 2)
    with pytest.raises(VersionError):
        core.report_task(task.task_id, 0, True, model_version=10 ** 12)
    assert core.tm.counts()["doing"] == 1  # the rejected report recorded nothing
    core.report_task(task.task_id, 0, True, model_version=1)  # stale: accepted
    assert core.version == 2


def test_future_version_is_invalid_argument_over_grpc_and_evaluation_goes_on():
    core = make_core(epochs=1, train=40)
    port = free_port()
    server = start_master_server(MasterServicer(core), port, host="127.0.0.1")
    client = MasterClient(f"127.0.0.1:{port}", worker_id=0, unavailable_timeout_s=20)
    version = 0
    client.version = lambda: version
    try:
        task = client.get_task()
        assert task.type == TaskType.TRAINING
        with pytest.raises(grpc.RpcError) as err:
            client.report_version(10 ** 12)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ahead of what the job could have produced" in err.value.details()
        version = 2
        client.report_task(task)
        evaluated = []
        while (task := client.get_task()).type != TaskType.NONE:
            assert task.type != TaskType.WAIT  # one worker: never kept waiting
            if task.type == TaskType.TRAINING:
                version += 2
            elif task.type == TaskType.EVALUATION:
                evaluated.append(task.model_version)
                client.report_evaluation(task, [("acc", 0.5, task.num_records)])
            client.report_task(task)
        assert evaluated == [4, 4]  # two evaluation tasks of the final model (40 records)
        assert [(e["model_version"], e["reasons"]) for e in core.report.evaluations] == \
            [(4, ["epoch_end", "final"])]
        assert core.version == 4 and core.claim_export(0) is False  # claimed at NONE
    finally:
        client.close()
        server.stop(0)


def _script(core: JobCore, workers: list[FakeWorker], steps: int) -> list:
    """A deterministic run of up to ``steps`` actions; what it observes."""
    seen = []
    for i in range(steps):
        if core.finished():
            break
        w = workers[i % 2]
        if w.held and i % 3:
            t = w.finish()
            seen.append(("done", t.task_id))
        else:
            t = w.take()
            seen.append(("got", t.type.name, t.task_id, t.start, t.epoch, t.model_version))
    return seen


@pytest.mark.parametrize("cut,phase", [(9, "pending"), (12, "running"), (14, "running"),
                                       (26, "training")] +
                         [(cut, None) for cut in range(1, 50, 3)])
def test_state_round_trip_through_json_keeps_future_behaviour(cut, phase):
    FakeWorker.shared["version"] = 0
    a = make_core(evaluation_steps=5, shuffle=True)
    wa = [FakeWorker(a, 0), FakeWorker(a, 1)]
    _script(a, wa, cut)
    model_at_cut = FakeWorker.shared["version"]  # the workers' model, ahead of reports
    # cut while an evaluation is due (training held), runs (its tasks held; at 14
    # one of its two tasks reported its metrics), or not; then at every third step
    if phase is not None:
        barrier = a.evaluations
        assert phase == ("pending" if barrier.pending else
                         "running" if barrier.running else "training")
    state = json.loads(json.dumps(a.state_dict()))
    b = make_core(evaluation_steps=5, shuffle=True)
    b.load_state_dict(state)
    assert b.state_dict()["tasks"] == a.state_dict()["tasks"]
    wb = [FakeWorker(b, 0), FakeWorker(b, 1)]
    for x, y in zip(wa, wb):  # the workers keep what they held across the restart
        y.held = list(x.held)
    ra = _script(a, wa, 500)
    FakeWorker.shared["version"] = model_at_cut
    rb = _script(b, wb, 500)
    assert a.finished() and b.finished()
    assert ra == rb and len(ra) > 2
    assert a.report.evaluations == b.report.evaluations
    evals = a.report.evaluations
    assert [e["epoch"] for e in evals if "epoch_end" in e["reasons"]] == [0, 1]
    assert "final" in evals[-1]["reasons"] and evals[-1]["model_version"] == 24
    assert a.tm.epochs_report() == b.tm.epochs_report()
    assert [e["records_completed"] for e in b.tm.epochs_report()] == [120, 120]
    assert a.version == b.version == 24


def test_state_round_trip_keeps_a_pending_evaluation_and_relaunch_bookkeeping():
    a = make_core(evaluation_steps=3)
    t1, t2 = a.get(0), a.get(1)
    a.on_version(0, 3)  # due; two training tasks held
    assert a.get(0).type == TaskType.WAIT
    w = a.replicas.new_worker()
    a.replicas.worker_reported(w, "boom", "tb")
    b = make_core(evaluation_steps=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for core in (a, b):
        core.report_task(t1.task_id, 0, True, model_version=3)
        assert core.get(0).type == TaskType.WAIT  # t2 still held: the barrier holds
        core.report_task(t2.task_id, 1, True, model_version=4)
        ev = core.get(0)
        assert (ev.type, ev.model_version) == (TaskType.EVALUATION, 4)
    assert b.replicas.first_failure == ("worker-0", "boom", "tb")
    assert b.replicas.new_worker() == 1


def test_evaluate_job_evaluates_its_start_version_once():
    tm = TaskManager(evaluation_shards=[("v", 0, 30)], records_per_task=20)
    core = JobCore(tm, JobReport("j", "Local", "local", 1, 0), job_type=JobType.EVALUATE,
                   start_version=77)
    core.begin()
    tasks = [core.get(0), core.get(0)]
    assert [t.model_version for t in tasks] == [77, 77]
    for t in tasks:
        core.report_evaluation(t.task_id, 77, [("acc", 1.0, t.num_records)])
        core.report_task(t.task_id, 0, True)
    assert core.finished()
    assert core.report.evaluations == [{"model_version": 77, "metrics": {"acc": 1.0},
                                        "reasons": ["evaluate"], "epoch": None}]
    assert core.report.final_metrics == {"acc": 1.0}


def test_a_hung_worker_does_not_block_a_due_evaluation():
    now = [0.0]
    tm = TaskManager([("t", 0, 40)], [("v", 0, 20)], records_per_task=20,
                     task_timeout_s=30, clock=lambda: now[0])
    core = JobCore(tm, JobReport("j", "Local", "local", 2, 0), Schedule(evaluation_steps=2),
                   minibatch_size=10)
    hung, other = core.get(0), core.get(1)
    core.report_task(other.task_id, 1, True, model_version=2)  # an evaluation is due
    assert core.get(1).type == TaskType.WAIT  # worker 0 still holds training
    now[0] = 31.0  # worker 0 holds its task past the timeout
    again = core.get(1)
    assert again.task_id == hung.task_id  # its work goes to another worker...
    core.report_task(again.task_id, 1, True, model_version=4)
    ev = core.get(1)  # ...and the evaluation starts without waiting for worker 0
    assert (ev.type, ev.model_version) == (TaskType.EVALUATION, 4)


def test_versions_from_a_ps_rolling_back_are_ignored_until_the_rollback_settles():
    """A relaunched PS rolled back to a checkpoint continues above every version used
    before; workers may report such versions before the master learns where versions
    continue. They are ignored then (not refused: a refusal fails a healthy worker)."""
    tm = TaskManager([("s", 0, 8)], records_per_task=4, num_epochs=1)
    core = JobCore.for_tasks(tm, minibatch_size=4)
    task = core.get(0)
    assert task.type == TaskType.TRAINING and core.version_bound() == 1
    core.begin_rollback()
    core.on_version(0, 115)                 # above the bound, during the rollback: ignored
    assert core.version == 0
    core.rollback({}, 110)                  # versions continue at 110
    core.on_version(0, 111)
    assert core.version == 111
    with pytest.raises(VersionError):       # the bound holds again
        core.on_version(0, 10**12)
