"""A model written with torch's own tables, trained by the PS trainer on 2 in-process PS
(issue 28): the worker holds no table weight, every push carries the tables as rows (never
a dense table gradient), and the parameters equal torch's own training of the same model."""

from __future__ import annotations

import importlib
import sys

import torch

from elasticdl.api.layers import Embedding
from elasticdl.api.model_spec import load_model_spec
from elasticdl.common.job_spec import JobSpec
from elasticdl.worker.ps_client import PSClient
from elasticdl.worker.ps_push import PushSession
from elasticdl.worker.ps_trainer import PSTrainer
from tests.conftest import FIXTURE_ZOO
from tests.unit.ps_helpers import local_ps, sgd

MODEL_DEF = "toy.ctr_bags.custom_model"
TABLES = {"sum_bag.weight", "max_bag.weight", "emb.weight"}


def _module():
    if FIXTURE_ZOO not in sys.path:
        sys.path.insert(0, FIXTURE_ZOO)
    return importlib.import_module("toy.ctr_bags")


def test_torch_tables_live_on_the_ps_and_train_as_torch_does(monkeypatch):
    mod = _module()
    records = mod.make_records(96, seed=4)
    batches = [mod.feed(records[i:i + 16], "training") for i in range(0, 96, 16)]
    job = JobSpec(model_zoo=FIXTURE_ZOO, model_def=MODEL_DEF, training_data="unused",
                  distribution_strategy="ParameterServerStrategy", seed=11,
                  ps_table_min_elements=0)
    pushed: dict[str, set[str]] = {"dense": set(), "sparse": set()}
    on_dense, on_sparse = PushSession.on_dense, PushSession.on_sparse

    def dense(self, name, grad):
        pushed["dense"].add(name)
        return on_dense(self, name, grad)

    def sparse(self, table, ids, grad):
        assert grad.shape == (ids.shape[0], 4) and ids.shape[0] < 50   # rows, not a table
        pushed["sparse"].add(table)
        return on_sparse(self, table, ids, grad)

    monkeypatch.setattr(PushSession, "on_dense", dense)
    monkeypatch.setattr(PushSession, "on_sparse", sparse)
    with local_ps(2, sgd(0.5)) as cluster:
        client = PSClient(cluster.addrs, rpc_timeout_s=20, reconnect_timeout_s=5)
        trainer = PSTrainer(load_model_spec(FIXTURE_ZOO, MODEL_DEF), cluster.addrs, job, 0,
                            torch.device("cpu"), client=client, init_timeout_s=20)
        try:
            assert set(trainer.tables) == TABLES
            assert set(dict(trainer.model.named_parameters())) == {"fc.weight", "fc.bias"}
            for name in ("sum_bag", "max_bag", "emb"):
                layer = getattr(trainer.model, name)
                assert isinstance(layer, Embedding) and layer.on_ps
                assert layer._parameters["weight"] is None
            for k, (features, labels) in enumerate(batches, 1):
                trainer.set_position(1, k, 16)
                trainer.train_minibatch(features, labels)
            state = trainer.state_dict_from_ps()
            # from the second step on, every table's rows came in one pull per PS before
            # the forward (their ids are feature tensors: worker/lookup_plan.py)
            assert (trainer.lookups.hits, trainer.lookups.misses) == \
                (len(TABLES) * (len(batches) - 1), 0)
        finally:
            trainer.close()
    assert pushed == {"dense": {"fc.weight", "fc.bias"}, "sparse": TABLES}
    torch.manual_seed(11)
    ref = mod.custom_model()
    opt = mod.optimizer(ref.parameters())
    for features, labels in batches:
        opt.zero_grad()
        mod.loss(labels, ref(*features)).backward()
        opt.step()
    expected = ref.state_dict()
    assert set(state) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
