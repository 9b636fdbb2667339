"""elasticdl.api.layers.Embedding in Local mode and on the PS; the DeepFM module's pieces."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
import torch

from elasticdl.api.layers import Embedding, LazyTableError, PulledRows, tables_on_ps
from elasticdl.common.tables import initial_rows
from tests.conftest import MODEL_ZOO


def test_local_embedding_is_an_nn_embedding():
    torch.manual_seed(0)
    layer = Embedding(20, 3, padding_idx=-1, initializer="uniform:-1:1")
    assert layer.padding_idx == 19 and set(layer.state_dict()) == {"weight"}
    ref = torch.nn.Embedding(20, 3, padding_idx=19)
    ref.load_state_dict(layer.state_dict())
    ids = torch.tensor([[1, 19, 4], [4, 0, 19]])
    out = layer(ids)
    assert torch.equal(out, ref(ids))
    assert torch.equal(layer.weight[19], torch.zeros(3))
    out.sum().backward()
    assert torch.equal(layer.weight.grad[19], torch.zeros(3))
    assert torch.equal(layer.weight.grad[4], torch.full((3,), 2.0))
    expected = initial_rows("uniform:-1:1", layer.seed, np.arange(20), 3, padding_idx=19)
    assert torch.equal(layer.weight.detach(), expected)


def test_seed_follows_torch_manual_seed_and_layers_differ():
    # lazy tables (initializer=...) draw a seed; materialised ones use torch's generator
    torch.manual_seed(5)
    a, b = Embedding(10, 2, initializer="normal"), Embedding(10, 2, initializer="normal")
    torch.manual_seed(5)
    a2 = Embedding(10, 2, initializer="normal")
    assert a.seed == a2.seed != b.seed
    assert torch.equal(a.weight, a2.weight) and not torch.equal(a.weight, b.weight)
    torch.manual_seed(5)
    a, b = Embedding(10, 2), Embedding(10, 2)
    torch.manual_seed(5)
    a2 = Embedding(10, 2)
    assert torch.equal(a.weight, a2.weight) and not torch.equal(a.weight, b.weight)


def test_tables_on_ps_skips_the_local_table_until_attached():
    with tables_on_ps():
        layer = Embedding(1_000_000, 8, initializer="normal")  # lazy: no local table
    with pytest.raises(LazyTableError, match="lazy table"):
        _ = layer.weight
    assert list(layer.parameters()) == []
    with pytest.raises(RuntimeError, match="never attached"):
        layer(torch.tensor([1]))
    seen = []
    layer.attach(lambda lyr, ids: seen.append(ids) or PulledRows(
        torch.zeros(1, 8), torch.zeros_like(ids)), "t")
    assert layer(torch.tensor([[3]])).shape == (1, 1, 8) and layer.on_ps
    assert "table on PS as 't'" in repr(layer)


def test_unsupported_options_are_refused():
    with pytest.raises(ValueError, match="max_norm"):
        Embedding(10, 2, max_norm=1.0)
    with pytest.raises(ValueError, match="initializer"):
        Embedding(10, 2, initializer="xavier")


@pytest.fixture(scope="module")
def deepfm():
    if MODEL_ZOO not in sys.path:
        sys.path.insert(0, MODEL_ZOO)
    return importlib.import_module("deepfm.deepfm"), importlib.import_module("deepfm.gen_data")


def test_deepfm_auc_matches_the_rank_definition(deepfm):
    mod, gen = deepfm
    rng = np.random.default_rng(0)
    labels = (rng.random(500) < 0.3).astype(np.float32)
    scores = np.round(rng.normal(size=500) + labels, 1)  # many ties
    got = float(mod.auc(torch.from_numpy(labels), torch.from_numpy(scores)))
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert abs(got - pairs) < 1e-6 and abs(gen.auc(labels, scores) - pairs) < 1e-9
    assert float(mod.auc(torch.ones(4), torch.randn(4))) == 0.5


def test_deepfm_trains_locally_on_planted_data(deepfm):
    mod, gen = deepfm
    data = gen.generate(2000, seed=1)
    torch.manual_seed(0)
    model = mod.DeepFM(field_sizes=gen.FIELD_SIZES[-3:], dim=4, hidden=(16,))
    ids = torch.from_numpy(data["ids"][:, -3:])
    records = [{"ids": i, "dense": d, "label": y}
               for i, d, y in zip(ids.numpy(), data["dense"], data["label"])]
    (f_ids, dense), labels = mod.feed(records, "training")
    assert f_ids.shape == (2000, 3) and dense.shape == (2000, 4) and labels.shape == (2000,)
    opt = mod.optimizer(model.parameters())
    for _ in range(30):
        opt.zero_grad()
        loss = mod.loss(labels, model((f_ids, dense)))
        loss.backward()
        opt.step()
    with torch.no_grad():
        metrics = {k: float(fn(labels, model((f_ids, dense))))
                   for k, fn in mod.eval_metrics_fn().items()}
    assert metrics["auc"] > 0.7, metrics
    assert mod.feed(records[:2], "prediction")[1] is None
