"""all_gather keeps autograd on gloo (2 processes); NCCL when CUDA has 2 devices."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from elasticdl.common.collective import all_gather, all_reduce, broadcast_state
from tests.integration.dist_procs import Procs, free_port

pytestmark = pytest.mark.integration


def _init(rank: int, port: int, backend: str) -> torch.device:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=20))
    if backend == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _gather_grads(rank: int, port: int, backend: str) -> dict:
    device = _init(rank, port, backend)
    try:
        out = {}
        for local in (True, False):
            x = (torch.ones(2, 2) if rank == 0 else torch.zeros(2, 2)).to(device)
            x.requires_grad_(True)
            y = x + 2
            y.retain_grad()
            seen: list = []
            y.register_hook(lambda g, seen=seen: seen.append(g.clone()))
            z = y * y
            z0, z1 = all_gather(z, local_grad=local)
            r = z0 * z1
            r.mean().backward()
            out[local] = (y.grad.cpu().tolist(), seen[0].cpu().tolist(), x.grad.cpu().tolist())
        # all_reduce with autograd: d(sum over ranks of (s*s).sum())/dx
        w = torch.full((3,), float(rank + 1), device=device, requires_grad=True)
        s = all_reduce(w)  # 3 on both ranks
        (s * s).sum().backward()
        out["all_reduce"] = (s.detach().cpu().tolist(), w.grad.cpu().tolist())
        # state broadcast: nested structure, mixed dtypes, a CPU scalar tensor
        state = {"a": torch.arange(4, dtype=torch.float32, device=device) + rank,
                 "opt": {"step": torch.tensor(7.0 + rank), "m": [torch.ones(2, 3) * rank]},
                 "n": torch.tensor([5 + rank], dtype=torch.int64, device=device),
                 "counters": {"epoch": 3 + rank}}
        got = broadcast_state(state if rank == 1 else {}, src=1, device=device)
        out["broadcast"] = (got["a"].cpu().tolist(), float(got["opt"]["step"]),
                            got["opt"]["step"].device.type, got["opt"]["m"][0].cpu().tolist(),
                            got["n"].cpu().tolist(), got["counters"])
        return out
    finally:
        dist.destroy_process_group()


def _run(backend: str) -> dict:
    procs = Procs()
    port = free_port()
    try:
        for rank in (0, 1):
            procs.start(rank, _gather_grads, rank, port, backend)
        return procs.collect([0, 1], timeout_s=60)
    finally:
        procs.close()


def _check(res: dict) -> None:
    # local_grad=True: each rank's own loss only (SimCLR GatherLayer semantics)
    assert res[0][True][0] == [[6.0, 6.0], [6.0, 6.0]]
    assert res[1][True][0] == [[9.0, 9.0], [9.0, 9.0]]
    # default: the sum of both ranks' (identical) losses
    assert res[0][False][0] == [[12.0, 12.0], [12.0, 12.0]]
    assert res[1][False][0] == [[18.0, 18.0], [18.0, 18.0]]
    for rank in (0, 1):
        for local in (True, False):
            y_grad, hook_grad, x_grad = res[rank][local]
            assert hook_grad == y_grad == x_grad  # tensor hooks and retain_grad see it
        s, w_grad = res[rank]["all_reduce"]
        assert s == [3.0, 3.0, 3.0]
        assert w_grad == [12.0, 12.0, 12.0]  # 2 ranks x d(s^2)/ds = 2 * 6
        a, step, step_dev, m, n, counters = res[rank]["broadcast"]
        assert a == [1.0, 2.0, 3.0, 4.0] and step == 8.0 and step_dev == "cpu"
        assert m == [[1.0] * 3] * 2 and n == [6] and counters == {"epoch": 4}


def test_all_gather_autograd_gloo():
    _check(_run("gloo"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="NCCL needs 2 CUDA devices")
def test_all_gather_autograd_nccl():
    _check(_run("nccl"))


def test_all_gather_without_a_group_is_identity():
    x = torch.ones(3, requires_grad=True)
    (out,) = all_gather(x)
    out.sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 1.0]
