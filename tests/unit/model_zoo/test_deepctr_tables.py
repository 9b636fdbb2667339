"""DeepCTR-Torch's DeepFM as published (the ``deepctr-torch`` package, the third model of
benchmarks/ctr_models.py): its torch tables, in ``nn.ModuleDict``s of the FM/DNN part and
of the linear part, become PS tables with the model code untouched, and the swapped model
gives DeepCTR's own outputs and gradients (rows pulled and pushed as the PS trainer does)."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
import torch

from elasticdl.api.layers import Embedding
from elasticdl.api.torch_tables import tables_to_ps
from tests.unit.ps.test_torch_tables import RowServer

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks")
SIZES = [50, 30, 20, 12, 9, 7, 6, 5, 5, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]


@pytest.fixture(scope="module")
def zoo():
    """``ctr_zoo.deepctr_criteo``, imported with DeepCTR-Torch's version check (a thread
    it starts on import that asks pypi.org) answered locally: tests talk to nobody."""
    requests = pytest.importorskip("requests")
    get = requests.get

    def offline(*_a, **_k):
        raise ConnectionError("tests are offline")

    requests.get = offline
    try:
        pytest.importorskip("deepctr_torch")
        for t in threading.enumerate():
            if t is not threading.current_thread() and not t.daemon:
                t.join(timeout=10)
    finally:
        requests.get = get
    path = os.path.abspath(BENCHMARKS)
    if path not in sys.path:
        sys.path.insert(0, path)
    from ctr_zoo import criteo_gen, deepctr_criteo

    return deepctr_criteo, criteo_gen


def test_deepctr_deepfm_tables_go_to_the_ps_and_train_as_deepctr_does(zoo):
    mod, gen = zoo
    ref = mod.build(SIZES, seed=3)
    twin = mod.build(SIZES, seed=3)
    twin.load_state_dict(ref.state_dict())
    swapped = tables_to_ps(twin, 0)
    # the FM/DNN tables (dim 16) and the linear part's (dim 1), one each per field
    assert sorted(swapped) == sorted([f"embedding_dict.C{i}" for i in range(26)] +
                                     [f"linear_model.embedding_dict.C{i}" for i in range(26)])
    servers = {}
    for name in swapped:
        layer = twin.get_submodule(name)
        assert isinstance(layer, Embedding)
        servers[name] = RowServer(ref.get_submodule(name).weight)
        layer.attach(servers[name], f"{name}.weight")
    assert not any(n.endswith(".weight") and n.rsplit(".", 1)[0] in servers
                   for n, _ in twin.named_parameters())   # the worker holds no table
    data = gen.generate(64, SIZES, seed=5)
    (x,), labels = mod.batch(data["dense"], data["cat"], data["label"])
    out_ref, out = ref(x), twin(x)
    assert torch.allclose(out, out_ref, rtol=1e-6, atol=1e-7)
    mod.loss(labels, out_ref).backward()
    mod.loss(labels, out).backward()
    for name, server in servers.items():
        expected = ref.get_submodule(name).weight.grad
        assert torch.allclose(server.grad(), expected, rtol=1e-5, atol=1e-8), name
        touched = np.unique(np.concatenate([u for u, _ in server.pulls]))
        assert touched.size <= 64   # rows of this minibatch's ids, never the table
    dense_ref = dict(ref.named_parameters())
    for n, p in twin.named_parameters():
        assert torch.allclose(p.grad, dense_ref[n].grad, rtol=1e-5, atol=1e-8), n
