"""torch's nn.Embedding / nn.EmbeddingBag swapped for PS tables (elasticdl.api.torch_tables):
the swapped module, looking up pulled unique rows, gives torch's own outputs and gradients."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

from elasticdl.api.layers import Embedding, EmbeddingBag, PulledRows
from elasticdl.api.torch_tables import TableSwapError, tables_to_ps
from elasticdl.worker.ps_push import dense_gradient

N, DIM = 12, 3


class RowServer:
    """What the PS trainer does for a lookup, over a dense table: pull the unique ids'
    rows as a leaf, remap the ids; ``grad()`` scatters the rows' gradients back."""

    def __init__(self, table: torch.Tensor):
        self.table = table.detach().clone()
        self.pulls: list[tuple[np.ndarray, torch.Tensor]] = []

    def __call__(self, layer: Embedding, ids: torch.Tensor) -> PulledRows:
        uniq, inverse = np.unique(ids.reshape(-1).numpy(), return_inverse=True)
        rows = self.table[torch.from_numpy(uniq)].clone().requires_grad_(True)
        self.pulls.append((uniq, rows))
        pad = None
        if layer.padding_idx is not None and layer.padding_idx in uniq:
            pad = int(np.searchsorted(uniq, layer.padding_idx))
        return PulledRows(rows, torch.from_numpy(inverse.reshape(ids.shape)), pad)

    def grad(self) -> torch.Tensor:
        out = torch.zeros_like(self.table)
        for uniq, rows in self.pulls:
            if rows.grad is not None:
                out.index_add_(0, torch.from_numpy(uniq), rows.grad)
        return out


def _swapped(module: nn.Module) -> tuple[nn.Module, RowServer]:
    holder = nn.Sequential(module)
    assert tables_to_ps(holder, 0) == ["0"]
    table = holder[0]
    assert isinstance(table, Embedding)
    server = RowServer(module.weight)
    table.attach(server, "0.weight")
    return table, server


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if grad.is_sparse else grad


BAG_CASES = list(itertools.product(("sum", "mean", "max"), (None, 2), (False, True),
                                   (False, True), (False, True)))


@pytest.mark.parametrize("mode,padding_idx,offsets,include_last,sparse", BAG_CASES)
def test_embedding_bag_modes_equal_torch(mode, padding_idx, offsets, include_last, sparse):
    if include_last and not offsets:
        pytest.skip("include_last_offset needs offsets")
    if mode == "max" and sparse:
        pytest.skip("torch refuses max mode with sparse=True")
    torch.manual_seed(1)
    ref = nn.EmbeddingBag(N, DIM, mode=mode, padding_idx=padding_idx, sparse=sparse,
                          include_last_offset=include_last)
    twin = nn.EmbeddingBag(N, DIM, mode=mode, padding_idx=padding_idx, sparse=sparse,
                           include_last_offset=include_last)
    twin.load_state_dict(ref.state_dict())
    swapped, server = _swapped(twin)
    assert isinstance(swapped, EmbeddingBag) and swapped.mode == mode
    if offsets:
        ids = torch.tensor([1, 2, 2, 5, 7, 2, 11, 1, 0])
        offs = torch.tensor([0, 3, 3, 6] + ([9] if include_last else []))  # an empty bag
        args: tuple = (ids, offs)
    else:
        ids = torch.tensor([[1, 2, 2], [5, 7, 2], [11, 1, 0]])
        args = (ids,)
    weights = None
    if mode == "sum":
        weights = torch.rand(ids.shape)
        args = args if offsets else (ids, None)
        args = (*args, weights)
    out, expected = swapped(*args), ref(*args)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    upstream = torch.randn_like(expected)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(server.grad(), _dense(ref.weight.grad), rtol=0, atol=1e-6)
    if padding_idx is not None:
        assert torch.equal(server.grad()[padding_idx], torch.zeros(DIM))


@pytest.mark.parametrize("padding_idx,scale,sparse", list(itertools.product(
    (None, 2), (False, True), (False, True))))
def test_embedding_equals_torch(padding_idx, scale, sparse):
    if scale and sparse:
        pytest.skip("torch's backward refuses scale_grad_by_freq with sparse gradients")
    torch.manual_seed(2)
    ref = nn.Embedding(N, DIM, padding_idx=padding_idx, scale_grad_by_freq=scale, sparse=sparse)
    swapped, server = _swapped(nn.Embedding.from_pretrained(ref.weight.detach().clone(),
                                                            freeze=False,
                                                            padding_idx=padding_idx,
                                                            scale_grad_by_freq=scale,
                                                            sparse=sparse))
    ids = torch.tensor([[1, 2, 2, 2], [5, 2, 11, 1]])
    out, expected = swapped(ids), ref(ids)
    assert torch.equal(out, expected)
    upstream = torch.randn_like(expected)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(server.grad(), _dense(ref.weight.grad), rtol=0, atol=1e-6)


class Model(nn.Module):
    def __init__(self, big: int = 64, sparse_small: bool = False):
        super().__init__()
        self.emb = nn.ModuleList([nn.EmbeddingBag(big, 4, mode="sum"),
                                  nn.EmbeddingBag(5, 4, sparse=sparse_small)])
        self.word = nn.Embedding(big, 4)
        self.small = nn.Embedding(5, 4)
        self.fc = nn.Linear(4, 1)


def test_swap_keeps_names_keys_values_and_threshold():
    torch.manual_seed(0)
    model = Model(sparse_small=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    swapped = tables_to_ps(model, 64 * 4)
    assert swapped == ["emb.0", "emb.1", "word"]   # big ones, and the sparse small one
    assert type(model.emb[0]) is EmbeddingBag and type(model.word) is Embedding
    assert type(model.small) is nn.Embedding
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert tables_to_ps(model, 64 * 4) == []      # idempotent: nothing torch's is left
    assert tables_to_ps(Model(), -1) == []        # off


@pytest.mark.parametrize("make,match", [
    (lambda: nn.EmbeddingBag(100, 4, max_norm=1.0), "max_norm"),
    (lambda: nn.Embedding.from_pretrained(torch.zeros(100, 4)), "frozen"),
])
def test_unsupported_tables_are_refused_naming_the_module(make, match):
    model = nn.Sequential(nn.Linear(1, 1), make())
    with pytest.raises(TableSwapError, match=rf"'1'.*{match}"):
        tables_to_ps(model, 0)


def test_tied_weights_and_unconverted_sparse_tables_are_refused():
    model = nn.Sequential(nn.Embedding(100, 4), nn.Linear(4, 100))
    model[1].weight = model[0].weight
    with pytest.raises(TableSwapError, match="shared"):
        tables_to_ps(model, 0)
    with pytest.raises(TableSwapError, match="sparse=True"):
        tables_to_ps(nn.Sequential(nn.EmbeddingBag(10, 4, sparse=True)), -1)


def test_a_sparse_gradient_of_a_dense_parameter_is_pushed_dense():
    weight = nn.Parameter(torch.randn(6, 2))
    torch.nn.functional.embedding(torch.tensor([1, 1, 4]), weight, sparse=True).sum().backward()
    assert weight.grad is not None and weight.grad.is_sparse
    dense = dense_gradient("w", weight.grad)
    assert not dense.is_sparse and dense.is_contiguous()
    assert torch.equal(dense, weight.grad.to_dense())


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_scale_grad_by_freq_equals_torch(mode):
    torch.manual_seed(3)
    ref = nn.EmbeddingBag(N, DIM, mode=mode, scale_grad_by_freq=True)
    twin = nn.EmbeddingBag(N, DIM, mode=mode, scale_grad_by_freq=True)
    twin.load_state_dict(ref.state_dict())
    swapped, server = _swapped(twin)
    ids = torch.tensor([[1, 2, 2], [2, 7, 1], [4, 4, 4]])
    out, expected = swapped(ids), ref(ids)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(server.grad(), ref.weight.grad, rtol=0, atol=1e-6)
