"""Tables exported sparse (issue 28): the file format, the documented loader, and a PS
trainer's export of a lazy 2^31-id table on 2 in-process PS."""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

from elasticdl.api.layers import EmbeddingBag
from elasticdl.api.model_spec import load_model_spec
from elasticdl.api.sparse_export import attach_rows, load_model
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.sparse_tables import (
    SparseExportWriter,
    export_bytes,
    read_manifest,
    read_tables,
)
from elasticdl.common.tables import TableSpec
from elasticdl.worker.ps_client import PSClient
from elasticdl.worker.ps_trainer import PSTrainer
from tests.conftest import FIXTURE_ZOO
from tests.unit.ps_helpers import local_ps, sgd

LAZY = TableSpec(name="bag.weight", num_embeddings=1 << 31, dim=3, initializer="normal:0.1",
                 seed=5)


def test_rows_round_trip_in_parts_and_unseen_ids_get_initial_rows(tmp_path):
    writer = SparseExportWriter(str(tmp_path), rows_per_part=4)
    ids = np.array([9, 2**31 - 1, 5, 70000, 3, 11, 12], dtype=np.int64)
    values = torch.arange(21, dtype=torch.float32).reshape(7, 3)
    writer.add(LAZY, ids[:5], values[:5])
    writer.add(LAZY, ids[5:], values[5:])
    writer.close()
    entry = read_manifest(str(tmp_path))["bag.weight"]
    assert entry["rows"] == 7 and len(entry["files"]) == 3 and entry["spec"] == LAZY
    rows = read_tables(str(tmp_path))["bag.weight"]
    assert rows.ids.tolist() == sorted(ids.tolist())
    got = rows.lookup(np.array([5, 4, 2**31 - 1]))
    assert torch.equal(got[0], values[2]) and torch.equal(got[2], values[1])
    assert torch.equal(got[1], LAZY.initial_rows(np.array([4]))[0])   # never trained
    with pytest.raises(IndexError, match="out of range"):
        rows.lookup(np.array([2**31]))
    assert export_bytes(str(tmp_path)) < 10_000


class TwoTables(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 3, mode="mean", padding_idx=0)
        self.emb = nn.Embedding(40, 3)
        self.fc = nn.Linear(6, 1)

    def forward(self, ids):
        return self.fc(torch.cat([self.bag(ids), self.emb(ids).sum(1)], 1))


def test_load_model_serves_torch_tables_from_their_rows(tmp_path):
    torch.manual_seed(0)
    trained = TwoTables()
    state = trained.state_dict()
    writer = SparseExportWriter(str(tmp_path))
    spec = TableSpec(name="bag.weight", num_embeddings=50, dim=3, explicit=True)
    writer.add(spec, np.arange(50)[::-1].copy(), state["bag.weight"].flip(0))
    writer.close()
    torch.save({k: v for k, v in state.items() if k != "bag.weight"},
               os.path.join(tmp_path, "model.pt"))
    model = load_model(str(tmp_path), TwoTables)
    assert isinstance(model.bag, EmbeddingBag) and model.bag.on_ps
    assert "bag.weight" not in model.state_dict()
    ids = torch.tensor([[0, 3, 3], [39, 1, 0]])
    torch.testing.assert_close(model(ids), trained(ids))
    with pytest.raises(ValueError, match="the model's is 40 x 3"):
        attach_rows(TwoTables(), {"emb.weight": read_tables(str(tmp_path))["bag.weight"]})


def _lazy_bags():
    if FIXTURE_ZOO not in sys.path:
        sys.path.insert(0, FIXTURE_ZOO)
    return importlib.import_module("toy.lazy_bags")


def test_ps_export_of_a_lazy_2_31_table_holds_the_rows_that_exist(tmp_path):
    mod = _lazy_bags()
    data = mod.write_data(str(tmp_path / "data"), 256, 500, seed=0)
    unseen = mod.write_data(str(tmp_path / "more"), 64, 4000, seed=3)
    job = JobSpec(model_zoo=FIXTURE_ZOO, model_def="toy.lazy_bags.custom_model",
                  training_data="unused", distribution_strategy="ParameterServerStrategy")
    with local_ps(2, sgd(0.5)) as cluster:
        client = PSClient(cluster.addrs, rpc_timeout_s=20, reconnect_timeout_s=5)
        trainer = PSTrainer(load_model_spec(FIXTURE_ZOO, job.model_def), cluster.addrs, job,
                            0, torch.device("cpu"), client=client, init_timeout_s=20)
        try:
            for k in range(4):
                trainer.set_position(1, k + 1, 64)
                trainer.train_minibatch(*mod.feed(data[64 * k:64 * (k + 1)], "training"))
            assert trainer.sparse_tables() == ["bag.weight"]
            paths = trainer.export_model(str(tmp_path / "out"))
            with torch.no_grad():
                expected = trainer.forward(mod.feed(unseen, "prediction")[0])
        finally:
            trainer.close()
    out = str(tmp_path / "out")
    assert paths[0] == os.path.join(out, "model.pt")
    assert set(torch.load(paths[0], weights_only=True)) == {"fc.weight", "fc.bias"}
    entry = read_manifest(out)["bag.weight"]
    assert entry["rows"] == np.unique(data[:, :3]).shape[0]
    model = load_model(out, mod.custom_model).eval()
    with torch.no_grad():
        got = model(mod.feed(unseen, "prediction")[0])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
