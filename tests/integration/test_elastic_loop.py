"""A model module's own ``train_loop(ctx)`` on 2 gloo processes: the MNIST CNN
custom-loop example on the digits data, with evaluation tasks in between."""

from __future__ import annotations

import os

import pytest
import torch

from elasticdl.api.model_spec import load_model_spec
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.task import TaskType
from elasticdl.data.registry import create_data_reader
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.rendezvous import Rendezvous
from elasticdl.master.task_manager import TaskManager
from tests.conftest import MODEL_ZOO
from tests.integration.dist_procs import Procs, free_port
from tests.integration.elastic_harness import FakeComm, FakeSource, MasterStandIn, connect

pytestmark = pytest.mark.integration

MODEL_DEF = "mnist.mnist_custom_loop.custom_model"


def _worker(address, worker_id: int, spec_json: str) -> dict:
    from elasticdl.worker.allreduce_trainer import AllreduceTrainer

    spec = JobSpec.from_json(spec_json)
    mgr = connect(address)
    model_spec = load_model_spec(MODEL_ZOO, MODEL_DEF)
    assert model_spec.train_loop is not None
    trainer = AllreduceTrainer(model_spec, spec, worker_id, torch.device("cpu"),
                               FakeComm(mgr.rdzv(), worker_id), "127.0.0.1")
    readers = {TaskType.TRAINING: create_data_reader(spec.training_data, {}),
               TaskType.EVALUATION: create_data_reader(spec.validation_data, {})}
    versions: list[int] = []
    stats = trainer.run(FakeSource(mgr.tm(), worker_id, mgr.agg()), readers,
                        on_step=[lambda v, loss: versions.append(v)])
    return {"version": trainer.model_version, "steps_counter": trainer.state.counters["steps"],
            "stats": (stats.tasks, stats.train_records, stats.eval_records),
            "versions": versions[-3:],
            "weight_sum": float(sum(p.detach().double().sum() for p in trainer.model.parameters()))}


def test_custom_train_loop_on_two_workers(digits_data):
    train, val = os.path.join(digits_data, "train"), os.path.join(digits_data, "val")
    spec = JobSpec(model_zoo=MODEL_ZOO, model_def=MODEL_DEF, training_data=train,
                   validation_data=val, distribution_strategy="AllreduceStrategy",
                   job_name="custom-loop", minibatch_size=32, num_minibatches_per_task=4,
                   num_epochs=2, num_workers=2, collective_timeout_s=10.0)
    train_reader = create_data_reader(train, {})
    val_reader = create_data_reader(val, {})
    tm = TaskManager(training_shards=list(train_reader.create_shards()),
                     evaluation_shards=list(val_reader.create_shards()),
                     records_per_task=spec.records_per_task, num_epochs=spec.num_epochs)
    agg = EvaluationAggregator()
    tm.evaluation_done_callbacks.append(agg.complete)
    tm.epoch_end_callbacks.append(lambda epoch: tm.create_evaluation_tasks(epoch + 1))
    rdzv = Rendezvous("127.0.0.1", free_port, settle_s=0.3, checkin_timeout_s=20,
                      initial_workers=2)
    master = MasterStandIn(rdzv, tm, agg)
    procs = Procs()
    try:
        for w in (0, 1):
            procs.start(w, _worker, master.address, w, spec.to_json())
        res = procs.collect([0, 1], timeout_s=55)
    finally:
        procs.close()
        master.close()

    assert tm.finished() and tm.failure is None
    n = tm.training_records
    assert [e["records_completed"] for e in tm.epochs_report()] == [n, n]
    assert sum(r["stats"][1] for r in res.values()) == 2 * n  # each record trained once
    assert res[0]["version"] == res[1]["version"]
    assert res[0]["weight_sum"] == res[1]["weight_sum"]     # identical replicas
    assert res[0]["steps_counter"] == res[1]["steps_counter"] > 0
    assert sorted(agg.results) == [1, 2]                 # an evaluation per epoch
    assert agg.results[2]["accuracy"] > 0.8, agg.results
