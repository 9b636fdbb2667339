"""Global-norm gradient clipping across parameter servers (issue 15, item 2).

One PS worker trains against two real PS (gRPC servers in this process; dense
parameters hashed to both, an embedding table split by id) with
``--clip_grad_norm``: the parameters equal single-process training with
``torch.nn.utils.clip_grad_norm_`` and the same optimizer within 1e-6, both
with streamed pushes (gradients leave during backward; the coefficient goes
with the last message) and unary ones. The same run without clipping comes
out measurably different, so the comparison can fail.
"""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
import torch

from elasticdl.api.model_spec import load_model_spec
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.task import Task, TaskType
from elasticdl.worker.ps_client import PSClient
from elasticdl.worker.ps_trainer import PSTrainer
from tests.unit.ps_helpers import local_ps

pytestmark = pytest.mark.integration

MODULE = "psclipnet"
SOURCE = '''
import torch
from torch import nn
from elasticdl.api.layers import Embedding


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = Embedding(40, 6, initializer="normal:0.5", seed=11)
        self.fc1 = nn.Linear(3 * 6 + 4, 16)
        self.fc2 = nn.Linear(16, 1)
        self.head = nn.Linear(4, 1)

    def forward(self, features):
        ids, x = features
        h = torch.relu(self.fc1(torch.cat([self.emb(ids).flatten(1), x], dim=1)))
        return (self.fc2(h) + self.head(x)).squeeze(-1)


def custom_model():
    return Net()


def loss(labels, outputs):
    return nn.functional.mse_loss(outputs, labels)


def optimizer(named_params):
    return torch.optim.SGD([p for _, p in named_params], lr=0.05)


def feed(records, mode):
    raise NotImplementedError("the test passes tensors")
'''
STEPS = 6
MAX_NORM = 0.5


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    zoo = tmp_path_factory.mktemp("zoo")
    (zoo / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    yield load_model_spec(str(zoo), f"{MODULE}.custom_model")
    sys.modules.pop(MODULE, None)


def _batches():
    rng = np.random.default_rng(5)
    out = []
    for _ in range(STEPS):
        ids = torch.from_numpy(rng.integers(0, 12, size=(16, 3)))  # many repeated ids
        x = torch.from_numpy(rng.normal(size=(16, 4)).astype(np.float32))
        y = torch.from_numpy((3 * rng.normal(size=16) + 4).astype(np.float32))
        out.append(((ids, x), y))
    return out


def _train_on_ps(spec, clip: float, chunk_bytes: int):
    job = JobSpec(model_zoo="unused", model_def=f"{MODULE}.custom_model",
                  training_data="unused", distribution_strategy="ParameterServerStrategy",
                  num_ps_pods=2, grads_to_wait=1, clip_grad_norm=clip, seed=3)
    with local_ps(2, spec, grads_to_wait=1) as cluster:
        client = PSClient(cluster.addrs, rpc_timeout_s=30, reconnect_timeout_s=5,
                          chunk_bytes=chunk_bytes)
        trainer = PSTrainer(spec, cluster.addrs, job, 0, torch.device("cpu"), client=client,
                            init_timeout_s=30)
        try:
            assert all(len(s.params.dense) for s in cluster.shards)  # dense on both PS
            initial = trainer.state_dict_from_ps()
            trainer.start_task(Task(1, TaskType.TRAINING, "mem", 0, 16 * STEPS))
            for k, (features, labels) in enumerate(_batches()):
                trainer.set_position(1, k + 1, 16)
                trainer.train_minibatch(features, labels)
            streamed = list(trainer.streaming)
            return initial, trainer.state_dict_from_ps(), streamed
        finally:
            trainer.close()


def _train_locally(spec, initial: dict, clip: float) -> tuple[dict, list[float]]:
    model = spec.build_model()  # the Embedding keeps its table here: a dense gradient
    model.load_state_dict(initial)
    opt = spec.make_optimizer(model.named_parameters())
    norms = []
    for features, labels in _batches():
        opt.zero_grad()
        spec.compute_loss(labels, model(features), model).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, norms


@pytest.mark.parametrize("chunk_bytes", [64, 1 << 20], ids=["streamed", "unary"])
def test_global_norm_clipping_on_two_ps_equals_clip_grad_norm(spec, chunk_bytes):
    initial, on_ps, streamed = _train_on_ps(spec, MAX_NORM, chunk_bytes)
    assert streamed == ([True, True] if chunk_bytes == 64 else [False, False])
    reference, norms = _train_locally(spec, initial, MAX_NORM)
    assert min(norms) > MAX_NORM  # clipping bites at every step
    assert set(on_ps) == set(reference)
    for name, value in reference.items():
        diff = float((on_ps[name] - value).abs().max())
        assert diff <= 1e-6, (name, diff)
    unclipped, _ = _train_locally(spec, initial, 0.0)
    assert max(float((unclipped[n] - v).abs().max()) for n, v in reference.items()) > 1e-3
