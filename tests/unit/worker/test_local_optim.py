"""LR schedulers, --clip_grad_norm and --amp in the Local trainer, each compared with
the plain-PyTorch loop that does the same (issue 15, items 1-2)."""

from __future__ import annotations

import itertools
import textwrap

import pytest
import torch
import torch.nn.functional as F

from elasticdl.api.model_spec import load_model_spec
from elasticdl.worker.trainer import LocalTrainer

_ids = itertools.count()

MODULE = """
import torch
import torch.nn.functional as F
from torch import nn

def custom_model():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

def feed(records, mode):
    x = torch.tensor([r[:6] for r in records], dtype=torch.float32)
    return x, torch.tensor([int(r[6]) for r in records])

def loss(labels, outputs):
    return F.cross_entropy(outputs, labels)

def optimizer(params, lr=0.5):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)
"""

STEP_SCHED = """
def lr_scheduler(optimizer):
    return {"scheduler": torch.optim.lr_scheduler.OneCycleLR(
                optimizer, max_lr=0.5, total_steps=12),
            "interval": "step"}
"""

EPOCH_SCHED = """
def lr_scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
"""


class _Task:
    def __init__(self, epoch: int):
        self.epoch = epoch


def _spec(tmp_path, extra: str = ""):
    name = f"localopt_mod_{next(_ids)}"
    (tmp_path / f"{name}.py").write_text(MODULE + textwrap.dedent(extra))
    return load_model_spec(str(tmp_path), f"{name}.custom_model")


def _batches(n: int, size: int = 8):
    g = torch.Generator().manual_seed(7)
    for _ in range(n):
        x = torch.randn(size, 6, generator=g) * 3
        y = torch.randint(0, 3, (size,), generator=g)
        yield x, y


def _reference(spec, batches, clip: float = 0.0, sched_fn=None):
    """The plain-PyTorch loop: same seed, same model/optimizer, clip_grad_norm_."""
    torch.manual_seed(0)
    model = spec.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = sched_fn(opt) if sched_fn is not None else None
    lrs = []
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
    return model, lrs


def test_step_interval_scheduler_matches_torch_step_by_step(tmp_path):
    spec = _spec(tmp_path, STEP_SCHED)
    trainer = LocalTrainer(spec, torch.device("cpu"))
    lrs = []
    for x, y in _batches(12):
        trainer.train_minibatch(x, y)
        lrs.append(trainer.last_lr)
    ref, ref_lrs = _reference(spec, _batches(12), sched_fn=lambda o: torch.optim.lr_scheduler
                              .OneCycleLR(o, max_lr=0.5, total_steps=12))
    assert lrs == ref_lrs            # exactly, step by step
    assert len(set(lrs)) > 6         # the schedule really moved
    for (k, p), q in zip(trainer.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6, msg=k)


def test_epoch_scheduler_steps_once_per_epoch_crossed_never_backwards(tmp_path):
    trainer = LocalTrainer(_spec(tmp_path, EPOCH_SCHED), torch.device("cpu"))
    seen = []
    batches = _batches(6)
    for epoch in (0, 0, 1, 1, 3, 2):     # 3 skips epoch 2; a late epoch-2 task changes nothing
        trainer.start_task(_Task(epoch))
        trainer.train_minibatch(*next(batches))
        seen.append(trainer.last_lr)
    assert seen == pytest.approx([1 * 0.5, 0.5, 0.5 * 0.7, 0.5 * 0.7, 0.5 * 0.7 ** 3,
                                  0.5 * 0.7 ** 3], abs=1e-15)


def test_resumed_trainer_continues_the_schedule_exactly(tmp_path):
    spec = _spec(tmp_path, EPOCH_SCHED)
    epochs = [0, 0, 1, 1, 2, 2, 3, 3]

    def run(trainer, part):
        out = []
        for epoch, (x, y) in part:
            trainer.start_task(_Task(epoch))
            trainer.train_minibatch(x, y)
            out.append(trainer.last_lr)
        return out

    steps = list(zip(epochs, _batches(8)))
    whole = LocalTrainer(spec, torch.device("cpu"))
    expected = run(whole, steps)
    first = LocalTrainer(spec, torch.device("cpu"))
    got = run(first, steps[:3])                  # stops inside epoch 1
    state = first.state_dict()
    resumed = LocalTrainer(spec, torch.device("cpu"), seed=123)   # other init: state wins
    resumed.load_state_dict(state)
    got += run(resumed, steps[3:])
    assert got == expected
    for p, q in zip(resumed.model.parameters(), whole.model.parameters()):
        assert torch.equal(p, q)


def test_clip_grad_norm_equals_plain_pytorch(tmp_path):
    spec = _spec(tmp_path)
    trainer = LocalTrainer(spec, torch.device("cpu"), clip_grad_norm=0.05)
    for x, y in _batches(5):
        trainer.train_minibatch(x, y)
    ref, _ = _reference(spec, _batches(5), clip=0.05)
    unclipped, _ = _reference(spec, _batches(5))
    for p, q in zip(trainer.model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
    assert any((q - u).abs().max() > 1e-3 for q, u in zip(ref.parameters(),
                                                         unclipped.parameters()))


def test_amp_bf16_on_cpu_trains_with_fp32_master_weights(tmp_path):
    trainer = LocalTrainer(_spec(tmp_path), torch.device("cpu"), amp="bf16")
    x, y = next(_batches(1, size=64))
    losses = []
    for _ in range(30):
        loss = trainer.train_minibatch(x, y)
        assert loss.dtype == torch.float32 or loss.dtype == torch.bfloat16
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert losses[-1] < 0.5 * losses[0]
    with trainer_autocast_probe(trainer) as dtypes:
        trainer.compute_loss(x, y)
    assert torch.bfloat16 in dtypes      # the forward really ran under bf16 autocast


class trainer_autocast_probe:
    """Records the dtype of the first Linear's output during a forward."""

    def __init__(self, trainer):
        self.layer = trainer.model[0]
        self.dtypes: list[torch.dtype] = []

    def __enter__(self):
        self.handle = self.layer.register_forward_hook(
            lambda m, i, o: self.dtypes.append(o.dtype))
        return self.dtypes

    def __exit__(self, *exc):
        self.handle.remove()


def test_amp_fp16_without_cuda_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="--amp=fp16 needs CUDA"):
        LocalTrainer(_spec(tmp_path), torch.device("cpu"), amp="fp16")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_amp_fp16_on_cuda_trains_with_a_grad_scaler(tmp_path):
    spec = _spec(tmp_path)
    trainer = LocalTrainer(spec, torch.device("cuda"), amp="fp16", clip_grad_norm=1.0)
    x, y = next(_batches(1, size=64))
    losses = [float(trainer.train_minibatch(x, y)) for _ in range(40)]
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert losses[-1] < 0.5 * losses[0]
    state = trainer.state_dict()
    assert state["extras"]["grad_scaler"]["scale"] > 0
    again = LocalTrainer(spec, torch.device("cuda"), amp="fp16")
    again.load_state_dict(state)
    assert again.extras.scaler.get_scale() == trainer.extras.scaler.get_scale()
