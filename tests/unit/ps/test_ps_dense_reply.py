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


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_next_step_trains_on_the_params_the_push_answer_brought(pulls, mode):
    spec = load_model_spec(FIXTURE_ZOO, MODEL_DEF)
    batches = spec.module.make_batches(6, 16, seed=0)
    config = {"grads_to_wait": 1, "use_async": mode == "async"}
    with local_ps(2, spec, **config) as cluster:
        client = PSClient(cluster.addrs, rpc_timeout_s=30)
        trainer = PSTrainer(spec, cluster.addrs, _job(**config), 0, torch.device("cpu"),
                            client=client, init_timeout_s=30)
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


def test_async_get_model_steps_wants_the_params_only_before_a_pull(pulls):
    spec = load_model_spec(FIXTURE_ZOO, MODEL_DEF)
    batches = spec.module.make_batches(6, 16, seed=1)
    config = {"grads_to_wait": 1, "use_async": True}
    with local_ps(2, spec, **config) as cluster:
        client = PSClient(cluster.addrs, rpc_timeout_s=30)
        trainer = PSTrainer(spec, cluster.addrs, _job(get_model_steps=3, **config), 0,
                            torch.device("cpu"), client=client, init_timeout_s=30)
        try:
            wanted = []
            for features, labels in batches:
                wanted.append(trainer.dense_reply_into(0) is not None)
                trainer.train_minibatch(features, labels)
            # steps 0..5 pull at 0 and 3: the answers of steps 2 and 5 bring the params
            assert wanted == [False, False, True, False, False, True]
            assert trainer.versions == [6, 6]
            # the initial pull and step 0's; none after: step 3's came with step 2's answer
            assert len(pulls) == 4
        finally:
            trainer.close()
