"""PS workers with schedules, clipping and fp16 loss scaling (issue 15, items 1-3),
against two real PS (gRPC servers in this process).

* every PS gets exactly one push per worker step, so a per-step scheduler is
  at the same count on every PS (sync and async), and the lr each step was
  applied with comes back to the worker (``last_lr``);
* the task's epoch travels with the pushes: an epoch scheduler on the PS
  follows the master's epochs;
* fp16: an overflowing step is skipped on every PS (which still counts it),
  the loss scale backs off as ``torch.amp.GradScaler``'s does.
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
from elasticdl.worker.ps_amp import LossScaler, clip_coefficient, push_scale
from elasticdl.worker.ps_client import PSClient
from elasticdl.worker.ps_trainer import PSTrainer
from tests.integration.ps_procs import run_in_threads
from tests.unit.ps_helpers import local_ps

MODULE = "pssched_net"
SOURCE = '''
import torch
from torch import nn
from elasticdl.api.layers import Embedding

INTERVAL = "step"
HUGE = False   # huge_model: a linear loss and a tiny learning rate


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = Embedding(20, 3, initializer="normal:0.1", seed=1)
        self.fc1 = nn.Linear(6, 4)
        self.fc2 = nn.Linear(4, 1)

    def forward(self, ids):
        return self.fc2(torch.relu(self.fc1(self.emb(ids).flatten(1)))).squeeze(-1)


def custom_model():
    return Net()


def loss(labels, outputs):
    return outputs.mean() if HUGE else nn.functional.mse_loss(outputs, labels)


def optimizer(params):
    return torch.optim.SGD(params, lr=1e-34 if HUGE else 0.5)


def lr_scheduler(optimizer):
    if INTERVAL == "step":
        return {"scheduler": torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.9),
                "interval": "step"}
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)


def named_optimizer(named_params, lr=0.5):
    """No weight decay on biases: groups by parameter name."""
    named = list(named_params)
    return torch.optim.SGD([
        {"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.1},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}], lr=lr)


def feed(records, mode):
    raise NotImplementedError


class Huge(nn.Module):
    """Gradient 1.5e34 per element, outside autocast's reach (mul/sum stay fp32):
    times a loss scale of 2**15 or more it overflows float32, times 2**14 not."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return (x * self.w).sum(1) * 1.5e34


def huge_model():
    return Huge()
'''


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    path = tmp_path_factory.mktemp("zoo")
    (path / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    yield str(path)
    sys.modules.pop(MODULE, None)


def _spec(zoo, interval="step", factory="custom_model"):
    spec = load_model_spec(zoo, f"{MODULE}.{factory}")
    sys.modules[MODULE].INTERVAL = interval
    return spec


def _job(**kw) -> JobSpec:
    return JobSpec(model_zoo="unused", model_def=f"{MODULE}.custom_model",
                   training_data="unused", distribution_strategy="ParameterServerStrategy",
                   num_ps_pods=2, seed=3, **kw)


def _trainer(spec, cluster, job, worker_id=0) -> PSTrainer:
    client = PSClient(cluster.addrs, rpc_timeout_s=30, reconnect_timeout_s=5)
    return PSTrainer(spec, cluster.addrs, job, worker_id, torch.device("cpu"), client=client,
                     init_timeout_s=30)


def _batch(k: int):
    rng = np.random.default_rng(k)
    return torch.from_numpy(rng.integers(0, 20, size=(8, 2))), \
        torch.from_numpy(rng.normal(size=8).astype(np.float32))


def _schedulers(cluster):
    return [s.schedule.schedule.scheduler for s in cluster.shards]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_step_scheduler_counts_agree_on_every_ps(zoo, mode):
    spec = _spec(zoo, "step")
    workers, steps = (1, 6) if mode == "sync" else (2, 5)
    config = {"grads_to_wait": 1, "use_async": mode == "async"}
    with local_ps(2, spec, **config) as cluster:
        trainers = [_trainer(spec, cluster, _job(**config), w) for w in range(workers)]
        try:
            seen: list[list[float]] = [[] for _ in trainers]

            def run(w: int) -> None:
                for k in range(steps):
                    trainers[w].train_minibatch(*_batch(10 * w + k))
                    seen[w].append(trainers[w].last_lr)

            run_in_threads([lambda w=w: run(w) for w in range(workers)], 120)
            total = workers * steps
            for shard, sched in zip(cluster.shards, _schedulers(cluster)):
                assert shard.version == total
                assert sched.last_epoch == total  # one scheduler step per applied update
                assert shard.schedule.lr() == pytest.approx(0.5 * 0.9 ** total)
            expected = {0.5 * 0.9 ** i for i in range(total)}
            got = [lr for lrs in seen for lr in lrs]
            assert sorted(got, reverse=True) == pytest.approx(sorted(expected, reverse=True))
            if mode == "sync":  # one worker: its k-th step was applied with 0.5 * 0.9**k
                assert seen[0] == pytest.approx([0.5 * 0.9 ** k for k in range(steps)])
        finally:
            for t in trainers:
                t.close()


def test_epoch_scheduler_follows_the_task_epochs(zoo):
    spec = _spec(zoo, "epoch")
    with local_ps(2, spec, grads_to_wait=1) as cluster:
        trainer = _trainer(spec, cluster, _job(grads_to_wait=1))
        try:
            for epoch in range(3):
                trainer.start_task(Task(epoch + 1, TaskType.TRAINING, "mem", 0, 16,
                                        epoch=epoch))
                for k in range(2):
                    trainer.set_position(epoch + 1, k + 1, 8)
                    trainer.train_minibatch(*_batch(k))
                    assert trainer.last_lr == pytest.approx(0.5 * 0.7 ** epoch, rel=1e-12)
            for shard in cluster.shards:
                assert shard.schedule.epoch == 2
                assert shard.schedule.lr() == pytest.approx(0.5 * 0.49)
        finally:
            trainer.close()


def test_ps_optimizer_gets_the_shards_named_parameters(zoo):
    spec = load_model_spec(zoo, f"{MODULE}.custom_model", optimizer="named_optimizer")
    sys.modules[MODULE].INTERVAL = "epoch"
    with local_ps(2, spec, grads_to_wait=1) as cluster:
        trainer = _trainer(spec, cluster, _job(grads_to_wait=1))
        try:
            trainer.train_minibatch(*_batch(0))
            for shard in cluster.shards:
                by_id = {id(p): n for n, p in shard.params.dense.items()}
                decayed, plain = shard.schedule.optimizer.param_groups
                names = [sorted(by_id.get(id(p), "placeholder") for p in g["params"])
                         for g in (decayed, plain)]
                assert all(not n.endswith("bias") for n in names[0]), names
                assert all(n.endswith("bias") for n in names[1]), names
                assert shard.schedule.interval == "epoch"
                assert sorted(names[0] + names[1]) == sorted(shard.params.dense)
        finally:
            trainer.close()


# ------------------------------------------------------------------ AMP
def test_loss_scaler_updates_like_torchs_amp_update_scale():
    ours = LossScaler(scale=1024.0, growth_interval=3)
    scale = torch.tensor(1024.0)
    tracker = torch.tensor(0, dtype=torch.int32)
    pattern = [False, False, False, True, False, False, False, False, True, True, False]
    for found in pattern:
        ours.update(found)
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(found)), 2.0, 0.5, 3)
        assert ours.scale == float(scale) and ours.growth_tracker == int(tracker)


def test_push_scale_unscales_clips_and_skips():
    class Norm:
        def __init__(self, total):
            self.value = total

        def total(self):
            return self.value

    scaler = LossScaler(scale=256.0)
    # unscaled norm 2.0; clip to 1.0: coefficient 1/(2+1e-6), then unscale by 1/256
    scale, discard = push_scale(Norm(512.0), 1.0, scaler)  # type: ignore[arg-type]
    assert not discard
    assert scale == pytest.approx(clip_coefficient(2.0, 1.0) / 256, rel=1e-6)
    assert scaler.growth_tracker == 1
    scale, discard = push_scale(Norm(float("inf")), 1.0, scaler)  # type: ignore[arg-type]
    assert discard and scaler.scale == 128.0 and scaler.growth_tracker == 0
    assert push_scale(Norm(3.0), 0.0, None) == (1.0, False)  # type: ignore[arg-type]
    with pytest.raises(FloatingPointError):
        push_scale(Norm(float("nan")), 1.0, None)  # type: ignore[arg-type]


def test_fp16_overflow_skips_the_step_on_every_ps_and_backs_off(zoo):
    """The scaler itself, on CPU (no CUDA here): the job asks for fp16, whose
    loss scale is what PSTrainer applies on any device."""
    spec = _spec(zoo, "step", factory="huge_model")
    sys.modules[MODULE].HUGE = True
    try:
        with local_ps(2, spec, grads_to_wait=1) as cluster:
            trainer = _trainer(spec, cluster, _job(grads_to_wait=1, amp="fp16"))
            try:
                assert trainer.scaler is not None and trainer.scaler.scale == 2.0 ** 16
                x, y = torch.ones(4, 4), torch.zeros(4)
                trainer.train_minibatch(x, y)  # 2**16: overflow, skipped
                trainer.train_minibatch(x, y)  # 2**15: overflow, skipped
                owner = next(s for s in cluster.shards if "w" in s.params.dense)
                assert torch.equal(owner.params.dense["w"], torch.ones(4))
                assert [s.version for s in cluster.shards] == [2, 2]  # both counted it
                trainer.train_minibatch(x, y)  # 2**14: applied, unscaled on the PS
                assert trainer.scaler.scale == 2.0 ** 14
                assert [s.version for s in cluster.shards] == [3, 3]
                # d loss / d w = 1.5e34 * mean over the batch of x (=1), and the per-step
                # scheduler counted the two skipped steps (as torch's does beside a
                # GradScaler): w -= 1e-34 * 0.9**2 * 1.5e34
                assert torch.allclose(owner.params.dense["w"],
                                      torch.full((4,), 1 - 0.81 * 1.5), atol=1e-5)
            finally:
                trainer.close()
    finally:
        sys.modules[MODULE].HUGE = False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_autocast_on_cuda_trains_on_the_ps(zoo):
    spec = _spec(zoo, "step")
    with local_ps(2, spec, grads_to_wait=1) as cluster:
        client = PSClient(cluster.addrs, rpc_timeout_s=30, reconnect_timeout_s=5)
        trainer = PSTrainer(spec, cluster.addrs, _job(grads_to_wait=1, amp="fp16",
                                                      clip_grad_norm=1.0),
                            0, torch.device("cuda"), client=client, init_timeout_s=30)
        try:
            losses = [float(trainer.train_minibatch(*_batch(0))) for _ in range(20)]
            assert losses[-1] < losses[0]
            assert [s.version for s in cluster.shards] == [20, 20]
        finally:
            trainer.close()
