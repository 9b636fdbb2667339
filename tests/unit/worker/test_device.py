"""Which device a worker trains on (``--device``)."""

from __future__ import annotations

import pytest
import torch

from elasticdl.worker.trainer import select_device


def test_auto_is_the_cpu_without_cuda_and_cuda_without_it_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_device("auto") == torch.device("cpu")
    assert select_device("cpu", 3) == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            select_device(name)


def test_a_cuda_device_always_has_an_index_spread_by_worker(monkeypatch):
    """A bare ``cuda`` failed every allreduce worker on a GPU (set_device and NCCL's
    device_id need an index); the workers of a local job spread over the GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [select_device("auto", w) for w in range(3)] == [
        torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 0)]
    assert select_device("cuda", 1) == torch.device("cuda", 1)
    assert select_device("cuda:1", 0) == torch.device("cuda", 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_selected_device_is_usable():
    device = select_device("cuda", 0)
    torch.cuda.set_device(device)
    assert torch.ones(2, device=device).sum().item() == 2
