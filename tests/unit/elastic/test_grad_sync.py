"""Allreduce training semantics (issue 10, items 5-8) on a real 2-process gloo group.

Both ranks run :class:`ElasticRunner` rounds on a fixed plan (no master): the
scenarios are run once per module in two spawned processes, and each test
checks the tensors they return — bitwise identity across members, and the
union-batch reference where one exists.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.integration.dist_procs import Procs, free_port

WORLD = 2


class _StaticComm:
    def __init__(self, rank: int, port: int):
        from elasticdl.master.rendezvous import CommPlan

        self.plan = CommPlan(1, rank, WORLD, ("127.0.0.1:0",) * WORLD, "127.0.0.1", port, True)

    def join(self, host: str, port: int) -> Any:
        return self.plan

    def get_comm_plan(self, known_version: int) -> Any:
        return self.plan

    def report_collective_failure(self, plan_version: int, reason: str) -> Any:
        raise RuntimeError(f"collective failed: {reason}")


def _data(rank: int, n: int = 8, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, 4, generator=g) + shift * rank
    return x, x.sum(1) * 0.5 + 0.1


class TwoBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 1)
        self.b = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, use_b: torch.Tensor) -> torch.Tensor:
        out = self.a(x)
        if bool(use_b):
            out = out + self.b(x)
        return out.squeeze(-1)


def bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def _runner(rank: int, port: int, model: nn.Module, opt: torch.optim.Optimizer,
            micro: int = 0) -> Any:
    from elasticdl.elastic.group import ElasticGroup
    from elasticdl.elastic.runner import ElasticRunner, ElasticState

    group = ElasticGroup(_StaticComm(rank, port), "127.0.0.1", "gloo", torch.device("cpu"),
                         timeout_s=20.0)
    runner = ElasticRunner(ElasticState(model, opt), group, torch.device("cpu"),
                           global_microbatches=micro)
    runner.start()
    return runner


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _scenarios(rank: int, ports: list[int]) -> bytes:
    out: dict[str, Any] = {}

    # item 5: rank 1 has no data and no filler in the first step; the step clips
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = _runner(rank, ports[0], model, opt)
    fillers: list[bool] = []

    def clip_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        fillers.append(runner.is_filler)
        opt.zero_grad()
        loss = F.mse_loss(model(x).squeeze(-1), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        opt.step()
        return loss.detach()

    runner.step_fn = clip_step
    if rank == 0:
        runner.submit(clip_step, _data(0), 8)
    else:
        runner.flush()
    out["item5"] = {"params": _snapshot(model), "fillers": fillers}
    runner.close()

    # item 6: a second backward (auxiliary loss on a retained graph) in the step
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = _runner(rank, ports[1], model, opt)

    def aux_step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        pred = model(x).squeeze(-1)
        F.mse_loss(pred, y).backward(retain_graph=True)
        (0.5 * (pred ** 2).mean()).backward()
        opt.step()

    runner.submit(aux_step, _data(rank), 8)
    out["item6"] = _snapshot(model)
    runner.close()

    # item 7: accumulation; branch b gets a gradient in the first microbatch only
    torch.manual_seed(0)
    model = TwoBranch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = _runner(rank, ports[2], model, opt, micro=2 * WORLD)

    def branch_step(x: torch.Tensor, y: torch.Tensor, use_b: torch.Tensor) -> None:
        opt.zero_grad()
        F.mse_loss(model(x, use_b), y).backward()
        opt.step()

    x, y = _data(rank, 16)
    runner.submit(branch_step, (x[:8], y[:8], torch.tensor(True)), 8)
    runner.submit(branch_step, (x[8:], y[8:], torch.tensor(False)), 8)
    out["item7"] = _snapshot(model)
    runner.close()

    # item 8: BatchNorm buffers with different data per member, a filler, an idle round
    torch.manual_seed(0)
    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = _runner(rank, ports[3], model, opt)

    def bn_step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.mse_loss(model(x).squeeze(-1), y).backward()
        opt.step()

    runner.step_fn = bn_step
    runner.submit(bn_step, _data(rank, shift=3.0), 8)
    both = _snapshot(model)
    if rank == 0:
        runner.submit(bn_step, _data(0, shift=3.0), 8)
    else:
        runner.flush()                      # a filler step: weight 0
    filler = _snapshot(model)
    runner.flush()                          # nobody has data: an idle round
    out["item8"] = {"both": both, "filler": filler, "idle": _snapshot(model)}
    runner.close()
    buf = io.BytesIO()  # by value: shared-memory tensors die with this process
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def results() -> dict[int, dict[str, Any]]:
    ports = [free_port() for _ in range(4)]
    procs = Procs()
    try:
        for r in range(WORLD):
            procs.start(r, _scenarios, r, ports)
        got = procs.collect(list(range(WORLD)), timeout_s=120)
        return {r: torch.load(io.BytesIO(v)) for r, v in got.items()}
    finally:
        procs.close()


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs between members: {a[k]} vs {b[k]}"


def test_item5_member_without_data_or_filler_runs_the_users_step_function(results):
    """Issue 10 item 5: no raw optimizer.step() — the clipping step runs on every member."""
    _assert_identical(results[0]["item5"]["params"], results[1]["item5"]["params"])
    assert results[0]["item5"]["fillers"] == [False]
    assert results[1]["item5"]["fillers"] == [True]  # rank 1 ran it on a received filler
    torch.manual_seed(0)  # reference: rank 0's batch alone, clipped
    ref = nn.Linear(4, 1)
    x, y = _data(0)
    F.mse_loss(ref(x).squeeze(-1), y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(results[1]["item5"]["params"][k], v, rtol=0, atol=1e-6)


def test_item6_every_backward_of_a_step_is_all_reduced(results):
    """Issue 10 item 6: an auxiliary second backward is averaged like the first."""
    _assert_identical(results[0]["item6"], results[1]["item6"])
    torch.manual_seed(0)
    ref = nn.Linear(4, 1)
    x = torch.cat([_data(r)[0] for r in range(WORLD)])
    y = torch.cat([_data(r)[1] for r in range(WORLD)])
    pred = ref(x).squeeze(-1)
    F.mse_loss(pred, y).backward(retain_graph=True)
    (0.5 * (pred ** 2).mean()).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(results[0]["item6"][k], v, rtol=0, atol=1e-6)


def test_item7_accumulation_keeps_earlier_microbatch_gradients(results):
    """Issue 10 item 7: a parameter without gradient in the last microbatch keeps
    the earlier microbatches' gradients (b trains like the union-batch reference)."""
    _assert_identical(results[0]["item7"], results[1]["item7"])
    torch.manual_seed(0)
    ref = TwoBranch()
    init = _snapshot(ref)
    total = torch.zeros(())
    for r in range(WORLD):
        x, y = _data(r, 16)
        total = total + F.mse_loss(ref(x[:8], torch.tensor(True)), y[:8]) * 8
        total = total + F.mse_loss(ref(x[8:], torch.tensor(False)), y[8:]) * 8
    (total / (16 * WORLD)).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(results[0]["item7"][k], v, rtol=0, atol=1e-6)
    assert not torch.equal(results[0]["item7"]["b.weight"], init["b.weight"])


def test_item8_batchnorm_buffers_are_synchronised_and_fillers_do_not_move_them(results):
    """Issue 10 item 8: running statistics identical on every member after every
    step; a filler step weighs 0; an idle round leaves them as they were."""
    r0, r1 = results[0]["item8"], results[1]["item8"]
    for phase in ("both", "filler", "idle"):
        _assert_identical(r0[phase], r1[phase])
    # records-weighted average == running mean of the union batch
    torch.manual_seed(0)
    ref = bn_model()
    x = torch.cat([_data(r, shift=3.0)[0] for r in range(WORLD)])
    ref(x)
    torch.testing.assert_close(r0["both"]["1.running_mean"], ref[1].running_mean,
                               rtol=0, atol=1e-5)
    assert int(r0["both"]["1.num_batches_tracked"]) == 1
    for k in ("1.running_mean", "1.running_var"):
        assert torch.equal(r0["idle"][k], r0["filler"][k]), k
