"""A unary push is answered with the PS's parameters once it is applied: the worker's next
step pulls nothing, and the parameters it trains on are exactly the PS's."""

from __future__ import annotations

import pytest
import torch

from elasticdl.api.model_spec import load_model_spec
from elasticdl.common.job_spec import JobSpec
from elasticdl.ps.servicer import PServicer
from elasticdl.worker.ps_client import PSClient
from elasticdl.worker.ps_trainer import PSTrainer
from tests.conftest import FIXTURE_ZOO
from tests.unit.ps_helpers import local_ps

MODEL_DEF = "toy.ctr.custom_model"


def _job(**kw) -> JobSpec:
    return JobSpec(model_zoo=FIXTURE_ZOO, model_def=MODEL_DEF, training_data="unused",
                   distribution_strategy="ParameterServerStrategy", seed=3, num_ps_pods=2,
                   **kw)


@pytest.fixture
def pulls(monkeypatch):
    """pull_dense calls each in-process PS answered."""
    counted: list[int] = []
    original = PServicer.pull_dense

    def pull_dense(self, request, context):
        counted.append(self.shard.config.ps_id)
        return original(self, request, context)

    monkeypatch.setattr(PServicer, "pull_dense", pull_dense)
    return counted


def _ps_params(addrs, names) -> dict[str, torch.Tensor]:
    """The PS's dense parameters now, through a fresh client's full pull."""
    client = PSClient(addrs, rpc_timeout_s=30)
    try:
        dest = {n: torch.empty_like(t) for n, t in names.items()}
        client.pull_dense([-1] * len(addrs), dest, [False] * len(addrs))
        return dest
    finally:
        client.close()


def test_next_step_trains_on_the_params_the_push_answer_brought(pulls):
    """Lockstep sync (one worker, ``grads_to_wait`` 1): every answer brings the version
    the next step would pull."""
    spec = load_model_spec(FIXTURE_ZOO, MODEL_DEF)
    batches = spec.module.make_batches(6, 16, seed=0)
    config = {"grads_to_wait": 1, "use_async": False}
    with local_ps(2, spec, **config) as cluster:
        client = PSClient(cluster.addrs, rpc_timeout_s=30)
        trainer = PSTrainer(spec, cluster.addrs, _job(num_workers=1, **config), 0,
                            torch.device("cpu"), client=client, init_timeout_s=30)
        try:
            assert trainer.streaming == [False, False]   # unary pushes: answered with params
            first = len(pulls)   # the initial pull of each PS
            for k, (features, labels) in enumerate(batches):
                trainer.train_minibatch(features, labels)
                held = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
                        if n in trainer.owner}
                on_ps = _ps_params(cluster.addrs, held)
                for name, value in on_ps.items():   # exactly the PS's newest parameters
                    assert torch.equal(held[name], value), (k, name)
                assert trainer.versions == [k + 1, k + 1]
            # the first step's (the parameters may have moved since the initial pull)
            # and the checks' own: none by the trainer after its first step
            assert len(pulls) - first == 2 + 2 * len(batches)
        finally:
            trainer.close()


@pytest.mark.parametrize("flags", [
    {"use_async": True, "grads_to_wait": 1, "num_workers": 1},
    {"use_async": False, "grads_to_wait": 1, "num_workers": 2},   # another push may come
])
def test_no_params_in_the_answer_unless_training_is_lockstep(pulls, flags):
    """Async, or fewer pushes a version than workers: another worker's push can move the
    PS after the answer; each step pulls at its start, as before."""
    spec = load_model_spec(FIXTURE_ZOO, MODEL_DEF)
    batches = spec.module.make_batches(4, 16, seed=1)
    config = {"grads_to_wait": 1, "use_async": flags["use_async"]}
    with local_ps(2, spec, **config) as cluster:
        client = PSClient(cluster.addrs, rpc_timeout_s=30)
        trainer = PSTrainer(spec, cluster.addrs, _job(**flags), 0, torch.device("cpu"),
                            client=client, init_timeout_s=30)
        try:
            first = len(pulls)
            for features, labels in batches:
                assert trainer.dense_reply_into(0) is None
                trainer.train_minibatch(features, labels)
            assert trainer.versions == [3, 3]   # pulled before the fourth step
            assert len(pulls) - first == 2 * len(batches)
        finally:
            trainer.close()
