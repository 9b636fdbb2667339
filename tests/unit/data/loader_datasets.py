"""Datasets for the DataLoader-process tests, in a module of their own: loader processes
start from a forkserver and import the dataset's module afresh (a test module would drag
pytest and every fixture along)."""

from __future__ import annotations

import threading
import time

import torch
from torch.utils.data import Dataset, get_worker_info

# held by a thread of the test process while the loader starts its processes: a
# forked process would inherit it held, forever
LOCK = threading.Lock()


class LockedSquares(Dataset):
    """``(i, i*i)``; every item takes :data:`LOCK` (as logging or an allocator would)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        with LOCK:
            return torch.tensor([float(i)]), torch.tensor(i * i)


class StuckInALoader(LockedSquares):
    """Record ``stuck_at`` never loads in a loader process (a hung read)."""

    def __init__(self, n: int, stuck_at: int):
        super().__init__(n)
        self.stuck_at = stuck_at

    def __getitem__(self, i: int):
        if i == self.stuck_at and get_worker_info() is not None:
            time.sleep(3600)
        return super().__getitem__(i)


class LoaderPids(Dataset):
    """Item ``i`` is ``(pid of the process that loaded it, i)``."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import os

        return torch.tensor([os.getpid()]), torch.tensor(i)
