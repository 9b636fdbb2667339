"""In-process parameter servers on 127.0.0.1 for tests."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Optional

import grpc
import torch

from elasticdl.ps.server import start_server
from elasticdl.ps.servicer import PServicer
from elasticdl.ps.shard import PSShard, ShardConfig


def sgd(lr: float = 0.1) -> Callable:
    return lambda params: torch.optim.SGD(params, lr=lr)


def push_together(shard: PSShard, pushes: list, timeout_s: float = 30.0) -> list:
    """``shard.push_gradients`` of every push at once, one thread each (a sync group
    waits for all of them); their results in order (None: still waiting)."""
    results: list = [None] * len(pushes)

    def push(i: int) -> None:
        results[i] = shard.push_gradients(pushes[i])

    threads = [threading.Thread(target=push, args=(i,)) for i in range(len(pushes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return results


@dataclass
class LocalPS:
    shards: list[PSShard]
    servers: list[grpc.Server]
    addrs: list[str]
    ports: list[int] = field(default_factory=list)

    def stop(self, i: int) -> None:
        self.servers[i].stop(0).wait(5)


@contextlib.contextmanager
def local_ps(num_ps: int = 1, optimizer: Optional[Callable] = None,
             **config) -> Iterator[LocalPS]:
    """``num_ps`` PS servers in this process (SGD lr 0.1 by default); all stopped on exit."""
    optimizer = optimizer or sgd()
    cluster = LocalPS([], [], [])
    try:
        for i in range(num_ps):
            shard = PSShard(ShardConfig(ps_id=i, num_ps=num_ps, **config), optimizer)
            server, port = start_server(PServicer(shard), 0, "127.0.0.1", max_workers=16)
            cluster.shards.append(shard)
            cluster.servers.append(server)
            cluster.ports.append(port)
            cluster.addrs.append(f"127.0.0.1:{port}")
        yield cluster
    finally:
        for server in cluster.servers:
            server.stop(0).wait(5)
