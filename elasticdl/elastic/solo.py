"""A one-member "rendezvous" for running the elastic allreduce machinery in one
process: ``--distribution_strategy=Local`` with a model module's
``train_loop(ctx)``.

:class:`SoloComm` answers every rendezvous call with the same ready plan of
world size 1 (rank 0, a TCPStore on a free loopback port), so a custom loop
gets the very ``ctx`` API it gets under AllreduceStrategy — ``ctx.step``,
``ctx.dataset``, ``ctx.all_reduce`` (a one-member gloo group) — and can be
debugged in one process.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

from elasticdl.elastic.group import CommPlanLike


@dataclass
class SoloPlan:
    """The plan of a one-member group (the fields of ``CommPlanLike``)."""

    plan_version: int
    rank: int
    world_size: int
    peer_addresses: Sequence[str]
    master_addr: str
    master_port: int
    ready: bool = True
    aborting: bool = False


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class SoloComm:
    """The rendezvous of a group whose only member is this process."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.plan: CommPlanLike = SoloPlan(1, 0, 1, (f"{host}:0",), host, _free_port(host))

    def join(self, host: str, port: int) -> CommPlanLike:
        return self.plan

    def get_comm_plan(self, known_version: int) -> CommPlanLike:
        return self.plan

    def report_collective_failure(self, plan_version: int, reason: str) -> CommPlanLike:
        # nobody else can have failed: a collective of a one-member group broke
        raise RuntimeError(f"collective of the one-member group failed: {reason}")
