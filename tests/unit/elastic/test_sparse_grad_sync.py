"""Sparse (row) gradients in allreduce (issue 28) on a real 2-process gloo group.

A model with ``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)``
tables and a dense part trains the same steps twice in each of two spawned
processes: through :class:`ElasticRunner` (tables all-gathered as rows, dense
parameters bucketed) and through torch's ``DistributedDataParallel`` on the same
batches. Parameters must agree (rtol 1e-5) with SGD and with Adagrad; the
members stay bitwise identical; accumulation (``--fixed_global_batch_size``) and a
filler step follow the union-batch reference.
"""

from __future__ import annotations

import datetime
import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.integration.dist_procs import Procs, free_port
from tests.unit.elastic.test_grad_sync import _snapshot, _StaticComm

WORLD = 2
STEPS = 4
ROWS = 50


class SparseModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, 4, sparse=True)
        self.bag = nn.EmbeddingBag(ROWS, 3, mode="mean", sparse=True)
        self.dense = nn.Linear(4 + 3 + 2, 1)

    def forward(self, ids: torch.Tensor, bag_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids).sum(1)
        b = self.bag(bag_ids)
        return self.dense(torch.cat([e, b, x], 1)).squeeze(-1)


def _batch(step: int, rank: int, n: int = 6) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + 7)
    # overlapping ids between members and repeats within a batch: coalescing matters
    ids = torch.randint(0, ROWS // 2, (n, 3), generator=g)
    bag = torch.randint(0, ROWS, (n, 4), generator=g)
    x = torch.randn(n, 2, generator=g)
    y = torch.randn(n, generator=g)
    return ids, bag, x, y


def _make(opt_name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = SparseModel()
    if opt_name == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.5)
    return model, torch.optim.Adagrad(model.parameters(), lr=0.3)  # sparse and dense grads


def _runner(rank: int, port: int, model: nn.Module, opt: torch.optim.Optimizer,
            micro: int = 0) -> Any:
    from elasticdl.elastic.group import ElasticGroup
    from elasticdl.elastic.runner import ElasticRunner, ElasticState

    # generous timeouts: the shared test machine can be very loaded
    group = ElasticGroup(_StaticComm(rank, port), "127.0.0.1", "gloo", torch.device("cpu"),
                         timeout_s=90.0)
    runner = ElasticRunner(ElasticState(model, opt), group, torch.device("cpu"),
                           global_microbatches=micro)
    runner.start()
    return runner


def _ours(rank: int, port: int, opt_name: str) -> dict[str, torch.Tensor]:
    model, opt = _make(opt_name)
    runner = _runner(rank, port, model, opt)

    def step(ids: torch.Tensor, bag: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.mse_loss(model(ids, bag, x), y).backward()
        assert model.emb.weight.grad is not None and model.emb.weight.grad.is_sparse
        opt.step()

    for s in range(STEPS):
        b = _batch(s, rank)
        runner.submit(step, b, len(b[3]))
    out = _snapshot(model)
    runner.close()
    return out


def _ddp(rank: int, port: int, opt_name: str) -> dict[str, torch.Tensor]:
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0,
                          timeout=datetime.timedelta(seconds=90))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=90))
    model, opt = _make(opt_name)
    ddp = nn.parallel.DistributedDataParallel(model)
    for s in range(STEPS):
        ids, bag, x, y = _batch(s, rank)
        opt.zero_grad()
        F.mse_loss(ddp(ids, bag, x), y).backward()
        opt.step()
    out = _snapshot(model)
    del ddp   # its reducer before its process group (destroyed after it, it blocks)
    dist.barrier()
    dist.destroy_process_group()
    return out


def _accumulated(rank: int, port: int) -> dict[str, Any]:
    """--fixed_global_batch_size for 4 over 2 members (2 microbatches each), then a
    step where rank 1 has no data (a filler weighing 0)."""
    model, opt = _make("sgd")
    runner = _runner(rank, port, model, opt, micro=2 * WORLD)

    def step(ids: torch.Tensor, bag: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.mse_loss(model(ids, bag, x), y).backward()
        opt.step()

    runner.step_fn = step
    for k in range(2):
        b = _batch(k, rank, n=5 + k)   # different sizes: records weighting matters
        runner.submit(step, b, len(b[3]))
    accumulated = _snapshot(model)
    if rank == 0:
        b = _batch(9, 0)
        runner.submit(step, b, len(b[3]))
        runner.submit(step, _batch(10, 0), 6)
    else:
        runner.flush()
    out = {"accumulated": accumulated, "filler": _snapshot(model)}
    runner.close()
    return out


def _aux(rank: int, port: int) -> dict[str, torch.Tensor]:
    """A second backward in the step (an auxiliary loss on the table's rows)."""
    model, opt = _make("sgd")
    runner = _runner(rank, port, model, opt)

    def step(ids: torch.Tensor, bag: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.mse_loss(model(ids, bag, x), y).backward()
        (0.1 * model.emb(ids).pow(2).mean()).backward()
        opt.step()

    b = _batch(0, rank)
    runner.submit(step, b, len(b[3]))
    out = _snapshot(model)
    runner.close()
    return out


def _member(rank: int, ports: list[int]) -> bytes:
    out: dict[str, Any] = {}
    for i, name in enumerate(("sgd", "adagrad")):
        out[f"ours_{name}"] = _ours(rank, ports[2 * i], name)
        out[f"ddp_{name}"] = _ddp(rank, ports[2 * i + 1], name)
    out["accumulation"] = _accumulated(rank, ports[4])
    out["aux"] = _aux(rank, ports[5])
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def results() -> dict[int, dict[str, Any]]:
    ports = [free_port() for _ in range(6)]
    procs = Procs()
    try:
        for r in range(WORLD):
            procs.start(r, _member, r, ports)
        got = procs.collect(list(range(WORLD)), timeout_s=600)
        return {r: torch.load(io.BytesIO(v)) for r, v in got.items()}
    finally:
        procs.close()


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad"])
def test_sparse_tables_train_like_ddp(results, opt_name):
    """Issue 28: sparse=True tables in allreduce equal DDP's parameters after the same
    steps (rtol 1e-5), every member bitwise identical."""
    ours0, ours1 = results[0][f"ours_{opt_name}"], results[1][f"ours_{opt_name}"]
    for k in ours0:
        assert torch.equal(ours0[k], ours1[k]), f"{k} differs between members"
    ddp = results[0][f"ddp_{opt_name}"]
    torch.manual_seed(0)
    init = SparseModel().state_dict()
    for k, v in ddp.items():
        torch.testing.assert_close(ours0[k], v, rtol=1e-5, atol=1e-6)
        assert not torch.equal(v, init[k]), f"{k} never trained"


def test_sparse_accumulation_and_filler_follow_the_union_batch(results):
    """Accumulated sparse grads (concatenated, coalesced) and records weighting give
    one process's step on the union batch; a filler member contributes nothing."""
    r0, r1 = results[0]["accumulation"], results[1]["accumulation"]
    for phase in ("accumulated", "filler"):
        for k in r0[phase]:
            assert torch.equal(r0[phase][k], r1[phase][k]), (phase, k)
    model, opt = _make("sgd")
    parts = [_batch(k, r, n=5 + k) for r in range(WORLD) for k in range(2)]
    ids, bag, x, y = (torch.cat([p[i] for p in parts]) for i in range(4))
    F.mse_loss(model(ids, bag, x), y).backward()
    opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(r0["accumulated"][k], v, rtol=1e-5, atol=1e-6)
    # the next step: rank 0's two minibatches only (rank 1 ran a filler)
    opt.zero_grad()
    parts = [_batch(9, 0), _batch(10, 0)]
    ids, bag, x, y = (torch.cat([p[i] for p in parts]) for i in range(4))
    F.mse_loss(model(ids, bag, x), y).backward()
    opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(r0["filler"][k], v, rtol=1e-5, atol=1e-6)


def test_a_second_backward_on_sparse_tables_is_reduced_too(results):
    """Every backward of a step is averaged, the sparse rows as well (the second
    backward's rows minus what the first reduction wrote)."""
    r0, r1 = results[0]["aux"], results[1]["aux"]
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k
    model, opt = _make("sgd")
    parts = [_batch(0, r) for r in range(WORLD)]
    ids, bag, x, y = (torch.cat([p[i] for p in parts]) for i in range(4))
    F.mse_loss(model(ids, bag, x), y).backward()
    (0.1 * model.emb(ids).pow(2).mean()).backward()
    opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(r0[k], v, rtol=1e-5, atol=1e-6)
