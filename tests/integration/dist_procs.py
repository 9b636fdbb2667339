"""Running functions in spawned processes for torch.distributed tests (127.0.0.1 only)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], args: Sequence[Any], key: Any, results: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch

    torch.set_num_threads(1)  # several processes share 2 cores
    if os.environ.get("ELASTICDL_TEST_LOG"):  # debugging: the workers' logs on stderr
        logging.basicConfig(level=os.environ["ELASTICDL_TEST_LOG"],
                            format=f"%(relativeCreated)7.0f [{key}] %(name)s: %(message)s")
    try:
        # pickled here, by value: through the queue torch shares a tensor's storage by
        # a file descriptor the parent fetches from this process, which may have exited
        # by then (FileNotFoundError in the parent, seen once in a loaded CI run)
        results.put((key, "ok", pickle.dumps(fn(*args))))
    except BaseException as e:  # sent to the parent, which fails the test with it
        results.put((key, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class Procs:
    """Spawned processes that report one result each; always stopped in :meth:`close`."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.results = self.ctx.Queue()
        self.procs: dict[Any, Any] = {}

    def start(self, key: Any, fn: Callable[..., Any], *args: Any) -> Any:
        p = self.ctx.Process(target=_entry, args=(fn, args, key, self.results), daemon=True)
        p.start()
        self.procs[key] = p
        return p

    def kill(self, key: Any) -> None:
        p = self.procs[key]
        if p.pid is not None and p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(5)

    def collect(self, keys: Sequence[Any], timeout_s: float) -> dict[Any, Any]:
        """Results of ``keys``; raises on a worker error or when time runs out."""
        out: dict[Any, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) < len(keys):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no result from {sorted(set(keys) - set(out))} "
                                   f"within {timeout_s:.0f} s")
            try:
                key, status, value = self.results.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if status == "error":
                raise AssertionError(f"process {key} failed: {value}")
            out[key] = pickle.loads(value)
        return out

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        for p in self.procs.values():
            p.join(5)
        self.results.close()
