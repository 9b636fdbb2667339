"""Exact global metrics on the master's side: per-task metric states kept as
opaque bytes, merged once by an EVALUATION_FINALIZE task on a worker, through
the job core, its journal (a master restarted at any point gives the same
exact result), the real gRPC servicer, and without torch on the master."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch

from elasticdl.api import metrics
from elasticdl.cluster.process import free_port
from elasticdl.common.enums import JobType
from elasticdl.common.job_report import JobReport
from elasticdl.common.task import TaskType
from elasticdl.local.task_source import LocalTaskSource
from elasticdl.master import evaluation
from elasticdl.master.evaluation import EvaluationAggregator, MetricStateError
from elasticdl.master.job import JobCore
from elasticdl.master.journal import Journal
from elasticdl.master.servicer import MasterServicer, start_master_server
from elasticdl.master.task_manager import TaskManager
from elasticdl.worker.eval_metrics import EvalMetrics
from elasticdl.worker.master_client import MasterClient
from tests.conftest import ROOT

sk = pytest.importorskip("sklearn.metrics")

N = 300
RNG = np.random.default_rng(4)
LABELS = RNG.integers(0, 2, N)
SCORES = (np.round(np.clip(0.3 * LABELS + RNG.normal(0.35, 0.25, N), 0, 1) * 8) / 8
          ).astype(np.float32)


def metric_map():
    return {"auc": metrics.AUC(), "acc": metrics.Accuracy(),
            "mse": lambda y, s: float(((y - s) ** 2).mean())}


def make_core() -> JobCore:
    tm = TaskManager(evaluation_shards=[("v", 0, N)], records_per_task=40)  # 8 tasks
    return JobCore(tm, JobReport("j", "Local", "local", 3, 0), job_type=JobType.EVALUATE,
                   start_version=5)


def work(source, task) -> None:
    """What a worker's task loop does with an evaluation or finalize task."""
    em = EvalMetrics(metric_map())
    if task.type == TaskType.EVALUATION:
        em.begin_task()
        for lo in range(task.start, task.end, 16):
            hi = min(lo + 16, task.end)
            em.update(torch.from_numpy(LABELS[lo:hi]).float(),
                      torch.from_numpy(SCORES[lo:hi]), hi - lo)
        source.report_evaluation(task, *em.end_task())
    else:
        assert task.type == TaskType.EVALUATION_FINALIZE and len(task.metric_states) == 8
        source.report_evaluation(task, em.finalize(task.metric_states))
    source.report_task(task)


def check_exact(core: JobCore) -> None:
    (ev,) = core.report.evaluations
    assert ev["model_version"] == 5
    m = ev["metrics"]
    assert abs(m["auc"] - sk.roc_auc_score(LABELS, SCORES)) <= 1e-12
    assert m["acc"] == pytest.approx(np.mean((SCORES >= 0.5) == (LABELS == 1)))
    assert m["mse"] == pytest.approx(np.mean((LABELS - SCORES) ** 2))  # plain: weighted mean
    assert core.report.final_metrics == m


def test_three_workers_any_order_give_sklearns_auc():
    core = make_core()
    core.begin()
    sources = [LocalTaskSource(core, worker_id=w) for w in range(3)]
    held, finalizers = [], []
    for step in range(200):  # take and finish out of order across the workers
        if core.finished():
            break
        src = sources[step % 3]
        task = src.get_task()
        if task.type not in (TaskType.WAIT, TaskType.NONE):
            held.append((src, task))
            finalizers += [task] if task.type == TaskType.EVALUATION_FINALIZE else []
        if len(held) >= 3 or task.type == TaskType.WAIT:
            src_, t = held.pop(1 if len(held) > 1 else 0)
            work(src_, t)
    assert core.finished() and len(finalizers) == 1
    check_exact(core)


def test_a_worker_dying_in_the_finalize_task_hands_it_to_another():
    core = make_core()
    core.begin()
    a, b = LocalTaskSource(core, worker_id=0), LocalTaskSource(core, worker_id=1)
    while (task := a.get_task()).type == TaskType.EVALUATION:
        work(a, task)
    assert task.type == TaskType.EVALUATION_FINALIZE
    core.recover_tasks(0)  # worker 0 died holding it
    again = b.get_task()
    assert again.type == TaskType.EVALUATION_FINALIZE and again.task_id == task.task_id
    work(b, again)
    assert core.finished()
    check_exact(core)


def test_master_restarted_at_any_point_gives_the_same_exact_result(tmp_path):
    a = make_core()
    a.attach_journal(Journal(str(tmp_path / "live")))
    a.begin()
    src = LocalTaskSource(a, worker_id=0)
    cut = 0
    while not a.finished():
        task = src.get_task()
        work(src, task)
        cut += 1
        if cut == 4:
            a.snapshot()  # states in the snapshot (base64) and in journal records after it
        copy = tmp_path / f"cut{cut}"
        shutil.copytree(tmp_path / "live", copy)
        b = make_core()
        b.restore(Journal(str(copy)))
        assert b.state_dict() == a.state_dict()
        # and the restored master finishes the evaluation exactly, from its state dict
        c = make_core()
        c.load_state_dict(json.loads(json.dumps(b.state_dict())))
        src_c = LocalTaskSource(c, worker_id=1)
        while not c.finished():
            work(src_c, src_c.get_task())
        check_exact(c)
    assert cut == 9  # 8 evaluation tasks and the finalize task
    check_exact(a)


def test_aggregator_keeps_states_opaque_bounded_and_counts_each_task_once(monkeypatch):
    agg = EvaluationAggregator()
    agg.add(3, 10, [("mse", 1.0, 4)], b"\x00blob-a")
    agg.add(3, 10, [("mse", 9.0, 4)], b"\x00again")  # a retried task's second report
    agg.add(3, 11, [("mse", 3.0, 4)], b"\x00blob-b")
    assert agg.states_for(3) == (b"\x00blob-a", b"\x00blob-b")
    assert agg.needs_finalize(3) and not agg.needs_finalize(3)  # one finalize task
    again = EvaluationAggregator()
    again.load_state_dict(json.loads(json.dumps(agg.state_dict())))
    assert again.state_dict() == agg.state_dict()
    again.add_final(3, [("auc", 0.75, 2)])
    again.add_final(3, [("auc", 0.1, 2)])  # the first result counts
    assert again.complete(3) == {"auc": 0.75, "mse": 2.0}
    monkeypatch.setattr(evaluation, "MAX_VERSION_STATE_BYTES", 20)
    with pytest.raises(MetricStateError, match="exceed the bounds"):
        agg.add(3, 12, [], b"x" * 10)
    assert agg.states_for(3) == (b"\x00blob-a", b"\x00blob-b")  # nothing recorded


def test_states_travel_over_grpc_and_oversized_ones_are_invalid(monkeypatch):
    core = make_core()
    core.begin()
    port = free_port()
    server = start_master_server(MasterServicer(core), port, host="127.0.0.1")
    clients = [MasterClient(f"127.0.0.1:{port}", worker_id=w, unavailable_timeout_s=20)
               for w in range(2)]
    try:
        first = clients[0].get_task()
        monkeypatch.setattr(evaluation, "MAX_TASK_STATE_BYTES", 64)
        with pytest.raises(grpc.RpcError) as err:
            clients[0].report_evaluation(first, [], b"y" * 65)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "exceed the bounds" in err.value.details()
        monkeypatch.undo()
        work(clients[0], first)
        n = 1
        while not core.finished():
            client = clients[n % 2]
            work(client, client.get_task())
            n += 1
        assert n == 9
        check_exact(core)
    finally:
        for c in clients:
            c.close()
        server.stop(0)


SCRIPT = r'''
import json, sys
from elasticdl.common.enums import JobType
from elasticdl.common.job_report import JobReport
from elasticdl.common.task import TaskType
from elasticdl.master.job import JobCore
from elasticdl.master.task_manager import TaskManager
tm = TaskManager(evaluation_shards=[("v", 0, 60)], records_per_task=20)
core = JobCore(tm, JobReport("j", "Local", "local", 1, 0), job_type=JobType.EVALUATE)
core.begin()
while (t := core.get(0)).type == TaskType.EVALUATION:
    core.report_evaluation(t.task_id, t.model_version, [("m", 1.0, 20)], b"\x80opaque")
    core.report_task(t.task_id, 0, True)
assert t.type == TaskType.EVALUATION_FINALIZE, t
assert core.evaluation_states(t.model_version) == (b"\x80opaque",) * 3
core.report_evaluation(t.task_id, t.model_version, [("auc", 0.5, 3)])
core.report_task(t.task_id, 0, True)
state = json.loads(json.dumps(core.state_dict()))
assert core.finished() and core.report.final_metrics == {"auc": 0.5, "m": 1.0}
sys.exit(1 if any(n.split(".")[0] == "torch" for n in sys.modules) else 0)
'''


def test_master_side_of_stateful_metrics_never_imports_torch():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
