"""elasticdl.api.layers.Embedding as a drop-in for torch.nn.Embedding: same rows for the
same seed, the usual init idioms, options, lazy tables and their errors."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from elasticdl.api.layers import Embedding, LazyTableError, tables_on_ps


def test_same_seed_same_rows_as_nn_embedding_and_later_layers_unchanged():
    torch.manual_seed(11)
    ref, ref_next = nn.Embedding(50, 6, padding_idx=3), nn.Linear(4, 2)
    torch.manual_seed(11)
    emb, emb_next = Embedding(50, 6, padding_idx=3), nn.Linear(4, 2)
    assert torch.equal(emb.weight, ref.weight)          # N(0, 1), drawn like nn.Embedding
    assert torch.equal(emb.weight[3], torch.zeros(6))
    assert torch.equal(emb_next.weight, ref_next.weight)  # the RNG stream is the same after
    emb.reset_parameters()
    assert not torch.equal(emb.weight, ref.weight) and torch.equal(emb.weight[3], torch.zeros(6))
    # positional arguments mean what they mean for nn.Embedding
    pos = Embedding(10, 3, None, None, 2.0, True, True)
    assert pos.scale_grad_by_freq and pos.sparse and pos.max_norm is None


@pytest.mark.parametrize("ps", [False, True])
def test_init_idioms_work_in_every_strategy(ps):
    """torchfm: xavier_uniform_(emb.weight.data); DeepCTR-Torch: normal_(emb.weight, std)."""
    with tables_on_ps() if ps else contextlib.nullcontext():
        a = Embedding(1000, 8)
        nn.init.xavier_uniform_(a.weight.data)
        b = Embedding(1000, 4, padding_idx=0)
        nn.init.normal_(b.weight, mean=0, std=1e-4)
    bound = (6 / (1000 + 8)) ** 0.5
    assert 0.9 * bound < float(a.weight.detach().abs().max()) <= bound
    assert 0.5e-4 < float(b.weight.detach().std()) < 2e-4


def test_forward_and_grads_equal_nn_embedding_with_options():
    ids = torch.tensor([[1, 4, 4], [4, 0, 7]])
    for kw in ({"padding_idx": 7}, {"scale_grad_by_freq": True}, {"sparse": True}):
        torch.manual_seed(2)
        ref = nn.Embedding(9, 3, **kw)
        torch.manual_seed(2)
        emb = Embedding(9, 3, **kw)
        out_ref, out = ref(ids), emb(ids)
        assert torch.equal(out, out_ref), kw
        (out_ref * torch.arange(18.).reshape(2, 3, 3)).sum().backward()
        (out * torch.arange(18.).reshape(2, 3, 3)).sum().backward()
        assert emb.weight.grad.is_sparse == ref.weight.grad.is_sparse == kw.get("sparse", False)
        assert torch.equal(emb.weight.grad.to_dense(), ref.weight.grad.to_dense()), kw


def test_from_pretrained_and_state_dict_interchange():
    rows = torch.randn(5, 2)
    emb = Embedding.from_pretrained(rows, freeze=False)
    assert torch.equal(emb.weight, rows) and emb.weight.requires_grad
    ref = nn.Embedding(5, 2)
    ref.load_state_dict(emb.state_dict())
    assert torch.equal(ref.weight, rows)
    assert not Embedding.from_pretrained(rows).weight.requires_grad


def test_unsupported_and_bad_options_fail_at_construction():
    with pytest.raises(ValueError, match="max_norm"):
        Embedding(10, 2, max_norm=1.0)
    with pytest.raises(ValueError, match="padding_idx"):
        Embedding(10, 2, padding_idx=10)
    with pytest.raises(ValueError, match="> 0"):
        Embedding(0, 2)
    with pytest.raises(ValueError, match="initializer"):
        Embedding(10, 2, initializer="xavier")


def test_tables_over_the_limit_are_lazy_and_weight_says_why(monkeypatch):
    monkeypatch.setattr(Embedding, "MATERIALIZE_MAX_BYTES", 1000)
    small = Embedding(10, 4)                  # 160 bytes: materialised
    assert not small.lazy and small.table_spec("s").explicit
    with tables_on_ps():
        big = Embedding(100, 4)               # 1600 bytes: lazy, no local weight
        chosen = Embedding(10, 4, initializer="uniform:-1:1")
    assert big.lazy and not big.table_spec("b").explicit and big.initializer == "normal"
    with pytest.raises(LazyTableError, match="MATERIALIZE_MAX_BYTES"):
        nn.init.xavier_uniform_(big.weight.data)
    with pytest.raises(LazyTableError, match="initializer='uniform:-1:1'"):
        _ = chosen.weight
    assert big.initial_weight() is None and list(big.parameters()) == []
    # outside the PS a lazy table has the rows the PS would create
    local = Embedding(100, 4)
    assert local.lazy and local.weight.shape == (100, 4)


def test_attached_table_has_no_weight_and_frozen_tables_refuse_the_ps():
    with tables_on_ps():
        emb = Embedding(20, 3)
    init = emb.initial_weight()
    assert init is not None and init.shape == (20, 3)
    emb.attach(lambda layer, ids: torch.zeros(ids.shape + (3,)), "emb.weight")
    assert list(emb.parameters()) == [] and "weight" not in emb.state_dict()
    with pytest.raises(LazyTableError, match="lives on the parameter servers"):
        _ = emb.weight
    frozen = Embedding.from_pretrained(torch.randn(4, 2))
    with pytest.raises(ValueError, match="frozen"):
        frozen.attach(lambda layer, ids: ids, "f.weight")
