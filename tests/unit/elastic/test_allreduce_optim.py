"""--clip_grad_norm and LR schedulers in AllreduceStrategy on a real 2-process gloo
group (issue 15, items 1-2): :class:`AllreduceTrainer` members clip the averaged
(global) gradient and step their schedulers at the same steps, so every member's
parameters are identical and equal single-process training on the union batch."""

from __future__ import annotations

import io
import textwrap
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.integration.dist_procs import Procs, free_port

WORLD = 2
CLIP = 0.05
STEPS = 4
SIZES = (8, 5)   # members hold different numbers of records: weighting matters

MODULE = """
import torch
import torch.nn.functional as F
from torch import nn

def custom_model():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

def feed(records, mode):
    raise NotImplementedError

def loss(labels, outputs):
    return F.cross_entropy(outputs, labels)

def optimizer(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)

def lr_scheduler(optimizer, interval="step"):
    if interval == "step":
        return {"scheduler": torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.8),
                "interval": "step"}
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
"""


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(SIZES[rank], 6, generator=g) * 3
    return x, torch.randint(0, 3, (SIZES[rank],), generator=g)


class _Tag:  # an elastic-dataset-like tag: only the epoch matters here
    def __init__(self, epoch: int, records: int):
        self.epoch = epoch
        self.records = records


def _member(rank: int, port: int, zoo: str, interval: str, epochs: list,
            scale: float = 0.0, overflow_at: int = -1, ahead: int = 0) -> bytes:
    from elasticdl.api.model_spec import load_model_spec
    from elasticdl.common.job_spec import job_spec_from_flags
    from elasticdl.worker.allreduce_trainer import AllreduceTrainer
    from tests.unit.elastic.test_grad_sync import _StaticComm

    spec = load_model_spec(zoo, "optim_mod.custom_model", model_kwargs={"interval": interval})
    job = job_spec_from_flags("train", {
        "model_zoo": zoo, "model_def": "optim_mod.custom_model", "training_data": zoo,
        "distribution_strategy": "AllreduceStrategy", "num_workers": WORLD,
        "clip_grad_norm": CLIP, "collective_timeout_s": 30})
    member = AllreduceTrainer(spec, job, rank, torch.device("cpu"),
                              _StaticComm(rank, port), "127.0.0.1")
    if scale:  # the --amp=fp16 GradScaler path, on CPU in fp32 (fp16 itself needs CUDA)
        member.extras.scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    if ahead and rank == 0:  # rank 0 resumed a state 2 epochs and `ahead` steps further
        member.extras.advance_epoch(2)
        member.state.model_version = ahead
    lrs = []
    try:
        for step in range(len(epochs)):
            epoch = epochs[step][rank]
            if epoch is None:   # no data this step: a filler member
                member.runner.flush()
            else:
                x, y = _batch(step, rank)
                if step == overflow_at and rank == 1:
                    x = x * 1e20   # a finite loss whose scaled loss overflows on rank 1 only
                member.runner.submit(member._step, (x, y), SIZES[rank],
                                     _Tag(epoch, SIZES[rank]) if epoch >= 0 else None)
            lrs.append(member.last_lr)
        out = {"params": {k: v.detach().clone() for k, v in member.model.state_dict().items()},
               "lrs": lrs, "extras": member.extras.state_dict(),
               "scale": member.extras.scaler.get_scale() if scale else None}
    finally:
        member.close()
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _run(tmp_path, interval: str, epochs: list, *extra: Any) -> dict[int, Any]:
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / "optim_mod.py").write_text(textwrap.dedent(MODULE))
    port = free_port()
    procs = Procs()
    try:
        for r in range(WORLD):
            procs.start(r, _member, r, port, str(zoo), interval, epochs, *extra)
        got = procs.collect(list(range(WORLD)), timeout_s=120)
    finally:
        procs.close()
    return {r: torch.load(io.BytesIO(v)) for r, v in got.items()}


def _reference(epochs: list, interval: str,
               skip: int = -1) -> tuple[torch.nn.Module, list]:
    """One process, the union of the step's batches, clip_grad_norm_, the scheduler."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched: Any = (torch.optim.lr_scheduler.ExponentialLR(opt, 0.8) if interval == "step"
                  else torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7))
    lrs, epoch = [], 0
    for step in range(STEPS):
        ranks = [r for r in range(WORLD) if epochs[step][r] is not None]
        step_epoch = max(epochs[step][r] for r in ranks)
        if interval == "epoch":
            for _ in range(step_epoch - epoch):
                sched.step()
            epoch = max(epoch, step_epoch)
        if step == skip:
            lrs.append(opt.param_groups[0]["lr"])
            continue
        xs, ys = zip(*(_batch(step, r) for r in ranks))
        opt.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if interval == "step":
            sched.step()
    return model, lrs


def _check(results: dict[int, Any], ref: torch.nn.Module, ref_lrs: list) -> None:
    a, b = results[0]["params"], results[1]["params"]
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs between members"
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(a[k], v, rtol=0, atol=1e-6, msg=k)
    assert results[0]["lrs"] == results[1]["lrs"] == pytest.approx(ref_lrs, abs=1e-15)


def test_global_norm_clipping_and_step_scheduler_equal_the_union_batch(tmp_path):
    epochs = [(0, 0)] * STEPS
    results = _run(tmp_path, "step", epochs)
    ref, ref_lrs = _reference(epochs, "step")
    _check(results, ref, ref_lrs)
    assert len(set(ref_lrs)) == STEPS


def test_epoch_scheduler_steps_at_the_agreed_epoch_on_every_member(tmp_path):
    # step 1: only rank 0 has data (epoch 1), rank 1 is a filler member; step 2: rank 1
    # is still on an epoch-1 batch while rank 0 reached epoch 2: the step's epoch is 2
    epochs = [(0, 0), (1, None), (2, 1), (2, 2)]
    results = _run(tmp_path, "epoch", epochs)
    ref, ref_lrs = _reference(epochs, "epoch")
    _check(results, ref, ref_lrs)
    assert ref_lrs == pytest.approx([0.5, 0.5 * 0.7, 0.5 * 0.49, 0.5 * 0.49], abs=1e-15)
    assert results[1]["extras"]["epoch"] == 2


def test_grad_scaler_unscales_after_the_allreduce_and_members_skip_the_same_steps(tmp_path):
    """The GradScaler path of --amp=fp16 (in fp32 on CPU: fp16 autocast needs CUDA):
    gradients are unscaled after the allreduce, an overflow on one member makes every
    member skip that step and back off its scale alike; the other steps equal the
    union batch with clipping."""
    epochs = [(0, 0)] * STEPS
    results = _run(tmp_path, "epoch", epochs, 2.0 ** 64, 1)
    ref, ref_lrs = _reference(epochs, "epoch", skip=1)
    _check(results, ref, ref_lrs)
    # one backoff (x0.5) on the overflow, no growth within 2000 steps
    assert results[0]["scale"] == results[1]["scale"] == 2.0 ** 63


def test_scheduler_state_is_broadcast_with_the_model(tmp_path):
    """The scheduler (and its epoch) travel in the state broadcast when the group forms:
    the member behind adopts the most advanced member's schedule. Steps here carry no
    epoch (-1), so nothing but the broadcast can move rank 1's learning rate."""
    epochs = [(-1, -1)] * 2
    results = _run(tmp_path, "epoch", epochs, 0.0, -1, 5)
    assert results[0]["lrs"] == results[1]["lrs"] == pytest.approx([0.5 * 0.49] * 2,
                                                                   abs=1e-15)
    assert results[1]["extras"]["epoch"] == 2
    a, b = results[0]["params"], results[1]["params"]
    assert all(torch.equal(a[k], b[k]) for k in a)
