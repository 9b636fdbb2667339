"""The torch-free ReduceLROnPlateau mirror decides exactly as torch's scheduler.

Random metric sequences (with plateaus, repeats, NaN) under random rules (every
mode, threshold mode, patience, cooldown, factor, min_lr, eps): after every step
the mirror's rates equal the real scheduler's, and so do the rates a holder
gets by applying the mirror's reduction count with :func:`reduce_lrs` to its
own param groups (what a PS shard or an allreduce member does)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from elasticdl.api.model_spec import LRSchedule, ScheduleClock
from elasticdl.common.plateau import PlateauRule, PlateauState, reduce_lrs


def _random_rule(rng: random.Random):
    return dict(mode=rng.choice(["min", "max"]), factor=rng.choice([0.1, 0.5, 0.7]),
                patience=rng.randint(0, 3), threshold=rng.choice([0.0, 1e-4, 0.01, 0.2]),
                threshold_mode=rng.choice(["rel", "abs"]), cooldown=rng.randint(0, 2),
                min_lr=rng.choice([0.0, 1e-3, [1e-3, 0.05]]), eps=rng.choice([1e-8, 1e-3]))


def _metrics(rng: random.Random, n: int) -> list[float]:
    out, v = [], rng.uniform(0.5, 2.0)
    for _ in range(n):
        r = rng.random()
        if r < 0.3:
            pass                         # a plateau: the same value again
        elif r < 0.35:
            out.append(float("nan"))
            continue
        else:
            v = v * rng.uniform(0.9, 1.1) + rng.uniform(-0.05, 0.05)
        out.append(v)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_mirror_matches_torch_on_random_sequences(seed):
    rng = random.Random(seed)
    kw = _random_rule(rng)
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD([{"params": [params[0]], "lr": 1.0},
                           {"params": [params[1]], "lr": 0.3}])
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **kw)
    rule = PlateauRule.of_scheduler(sched, "loss", [g["lr"] for g in opt.param_groups])
    rule = PlateauRule.from_json(rule.to_json())            # as the master receives it
    mirror = PlateauState(rule)
    # a holder: its own optimizer, reductions applied by count (ScheduleClock)
    hopt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1.0},
                            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.3}])
    holder = ScheduleClock(LRSchedule(torch.optim.lr_scheduler.ReduceLROnPlateau(hopt, **kw),
                                      "evaluation", "loss"))
    reductions = 0
    for i, m in enumerate(_metrics(rng, 30)):
        sched.step(m)
        reduced = mirror.step(m, version=i)
        reductions += reduced
        torch_lrs = [g["lr"] for g in opt.param_groups]
        assert mirror.lrs == torch_lrs, (i, m, kw)
        assert mirror.num_bad_epochs == sched.num_bad_epochs
        assert mirror.cooldown_counter == sched.cooldown_counter
        assert (mirror.best == sched.best) or (math.isnan(mirror.best) and
                                                 math.isnan(sched.best))
        holder.catch_up_reductions(mirror.reductions)
        assert [g["lr"] for g in hopt.param_groups] == torch_lrs
    assert mirror.reductions == reductions
    # a restarted master continues from the JSON state alike
    again = PlateauState(rule)
    again.load_state_dict(json.loads(json.dumps(mirror.state_dict())))
    assert again.state_dict() == mirror.state_dict()


def test_catch_up_is_idempotent_and_monotonic():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    clock = ScheduleClock(LRSchedule(torch.optim.lr_scheduler.ReduceLROnPlateau(
        opt, factor=0.5), "evaluation", "loss"))
    assert clock.catch_up_reductions(2)
    assert opt.param_groups[0]["lr"] == 0.25
    assert not clock.catch_up_reductions(2)        # the same count again: nothing
    assert not clock.catch_up_reductions(1)        # an older count: nothing
    assert opt.param_groups[0]["lr"] == 0.25
    assert clock.catch_up_reductions(3)
    assert opt.param_groups[0]["lr"] == 0.125


def test_reduce_lrs_floor_and_eps():
    assert reduce_lrs([1.0, 0.01], 0.1, [0.05], 1e-8) == [0.1, 0.01]   # floor holds 0.01
    assert reduce_lrs([1e-8], 0.5, [0.0], 1e-8) == [1e-8]               # below eps: kept
    with pytest.raises(ValueError, match="min_lrs"):
        reduce_lrs([1.0, 1.0, 1.0], 0.5, [0.0, 0.0], 1e-8)


def test_rule_rejects_bad_parameters():
    with pytest.raises(ValueError, match="monitor"):
        PlateauRule(monitor="")
    with pytest.raises(ValueError, match="factor"):
        PlateauRule(monitor="loss", factor=1.0)
    with pytest.raises(ValueError, match="mode"):
        PlateauRule(monitor="loss", mode="up")
