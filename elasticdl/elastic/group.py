"""A worker's membership in the elastic allreduce group: plans in, process groups out.

:class:`ElasticGroup` talks to the master's rendezvous through a
:class:`CommClient` (the worker's gRPC ``MasterClient``, or an in-process fake in
tests) and turns each plan it is a member of into a torch.distributed default
process group: the plan's rank 0 hosts a fresh ``TCPStore`` on
``master_addr:master_port`` and every member connects to it; keys are prefixed
with the plan version. Every wait is bounded: store connection and collectives
by ``timeout_s`` (``--collective_timeout_s``, not torch's 30-minute default),
the wait for a usable plan by ``rendezvous_timeout_s``.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from elasticdl.common import collective
from elasticdl.common.collective import CollectiveError, guard

logger = logging.getLogger(__name__)


class CommPlanLike(Protocol):
    """What a plan carries (``elasticdl.proto.CommPlan`` or ``rendezvous.CommPlan``)."""

    plan_version: int
    rank: int
    world_size: int
    peer_addresses: Sequence[str]
    master_addr: str
    master_port: int
    ready: bool
    aborting: bool


class CommClient(Protocol):
    """The master's rendezvous as a worker sees it (``MasterClient`` implements it).

    Each call may raise ``ConnectionError`` when the master is unreachable.
    """

    def join(self, host: str, port: int) -> CommPlanLike: ...

    def get_comm_plan(self, known_version: int) -> CommPlanLike: ...

    def report_collective_failure(self, plan_version: int, reason: str) -> CommPlanLike: ...


class RendezvousTimeout(TimeoutError):
    """No usable plan within ``rendezvous_timeout_s``."""


def default_backend(device: torch.device, override: str = "") -> str:
    """``--comm_backend`` if given, else NCCL on CUDA and gloo otherwise."""
    if override:
        return override
    return "nccl" if device.type == "cuda" else "gloo"


class ElasticGroup:
    """This worker's current process group, re-formed from the master's plans.

    Args:
        comm: the master's rendezvous.
        host / port: this worker's address, sent with ``join``.
        backend: ``gloo`` or ``nccl``.
        device: where collective buffers live (the CUDA device for NCCL).
        timeout_s: store connection and collective timeout.
        rendezvous_timeout_s: longest wait for a plan that includes this worker.
        poll_s: interval between ``get_comm_plan`` calls while a plan forms.
        check_interval_s: least time between the polls of :meth:`change_pending`.
        abort_poll_s: least time between the polls of :meth:`should_abort` (gloo:
            while a collective is slow, the master is asked whether the plan broke).
    """

    def __init__(self, comm: CommClient, host: str, backend: str, device: torch.device,
                 timeout_s: float, port: int = 0, rendezvous_timeout_s: float = 600.0,
                 poll_s: float = 0.1, check_interval_s: float = 1.0,
                 abort_poll_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.comm = comm
        self.host = host
        self.port = port
        self.backend = backend
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.poll_s = poll_s
        self.check_interval_s = check_interval_s
        self.abort_poll_s = abort_poll_s
        self._last_abort_check = 0.0
        self._clock = clock
        self._sleep = sleep
        self.plan: Optional[CommPlanLike] = None
        self.active = False
        self.rejoined = False   # the last form() had to join (continuity with the past is lost)
        self.formations = 0
        self._store: Optional[Any] = None
        self._last_version = 0
        self._joined = False
        self._last_check = 0.0

    @property
    def rank(self) -> int:
        return int(self.plan.rank) if self.plan is not None and self.active else 0

    @property
    def world_size(self) -> int:
        return int(self.plan.world_size) if self.plan is not None and self.active else 1

    @property
    def version(self) -> int:
        return self._last_version

    # ------------------------------------------------------------ forming
    def form(self) -> None:
        """Block until a ready plan newer than the last one includes this worker,
        then create its process group.

        Raises:
            RendezvousTimeout: no such plan within ``rendezvous_timeout_s``.
        """
        if self.active:
            raise RuntimeError("form() while a group is active; leave() first")
        deadline = self._clock() + self.rendezvous_timeout_s
        self.rejoined = False
        if not self._joined:
            plan = self._join()
        else:
            plan = self.comm.get_comm_plan(self._last_version)
        while True:
            if plan.ready and plan.plan_version > self._last_version:
                if plan.rank < 0:
                    logger.info("not a member of plan %d; joining again", plan.plan_version)
                    plan = self._join()
                    continue
                try:
                    self._init(plan)
                    return
                except CollectiveError as e:
                    logger.warning("forming plan %d failed: %s", plan.plan_version, e)
                    self._last_version = int(plan.plan_version)
                    plan = self.comm.report_collective_failure(plan.plan_version, str(e))
                    continue
            if plan.ready and plan.rank >= 0 and plan.plan_version <= self._last_version:
                # the master still shows the plan this worker left: tell it why
                plan = self.comm.report_collective_failure(plan.plan_version,
                                                           "member left the group")
            if self._clock() >= deadline:
                raise RendezvousTimeout(
                    f"no plan including this worker within {self.rendezvous_timeout_s:.0f} s "
                    f"(last seen: version {plan.plan_version}, ready={plan.ready})")
            self._sleep(self.poll_s)
            plan = self.comm.get_comm_plan(self._last_version)

    def _join(self) -> CommPlanLike:
        self._joined = True
        self.rejoined = True
        return self.comm.join(self.host, self.port)

    def _init(self, plan: CommPlanLike) -> None:
        version, rank, world = int(plan.plan_version), int(plan.rank), int(plan.world_size)
        logger.info("forming plan %d: rank %d of %d, store %s:%d, %s", version, rank, world,
                    plan.master_addr, plan.master_port, self.backend)
        if self.backend == "nccl":
            # wait() raises on timeout or a lost peer (instead of the watchdog killing the
            # process), and we abort the communicators ourselves in _teardown
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            # every member names its gloo/NCCL group "0" under this plan's store prefix;
            # torch counts groups up from there and only a destroy resets the count, so a
            # member whose last init failed would otherwise never meet the others
            from torch.distributed import distributed_c10d as c10d

            c10d._world.group_count = 0
        try:
            with guard("store connect"):
                self._store = dist.TCPStore(plan.master_addr, int(plan.master_port), world,
                                            is_master=(rank == 0), timeout=self.timeout,
                                            wait_for_workers=False)
            with guard("init_process_group"):
                dist.init_process_group(
                    self.backend, store=dist.PrefixStore(f"elasticdl/plan-{version}",
                                                         self._store),
                    rank=rank, world_size=world, timeout=self.timeout,
                    device_id=self.device if self.backend == "nccl" else None)
                # connect every pair now, so a dead member shows up here, not mid-step
                dist.barrier()
        except CollectiveError:
            self._teardown(abort=True)
            raise
        self.plan = plan
        self._last_version = version
        self.active = True
        self.formations += 1
        self._last_check = self._last_abort_check = self._clock()
        if self.backend == "gloo":  # NCCL: wait() semantics differ; its own timeouts apply
            collective.set_abort_check(self.should_abort)

    # ------------------------------------------------------------ leaving
    def leave(self) -> None:
        """Destroy the process group (a planned change; nothing is reported)."""
        self._teardown(abort=False)

    def fail(self, reason: str) -> None:
        """Destroy a broken group and report the failure to the master."""
        version = self._last_version
        started = time.monotonic()
        self._teardown(abort=True)
        took = time.monotonic() - started
        if took > 1.0:
            logger.warning("destroying the group of plan %d took %.2f s", version, took)
        logger.warning("plan %d failed: %s", version, reason)
        self.comm.report_collective_failure(version, reason[:2000])

    def _teardown(self, abort: bool) -> None:
        self.active = False
        collective.set_abort_check(None)
        if dist.is_initialized():
            from torch.distributed import distributed_c10d as c10d

            if abort and self.backend == "nccl":
                c10d._abort_process_group()  # a hung communicator must not block us
                collective.dispose([])
            elif abort:
                # a collective may still be pending on a dead or hung peer: the group's
                # destructor would wait for it, so it runs on a background thread
                pg = c10d._get_default_group()
                dist.destroy_process_group()
                collective.dispose([pg, self._store])
            else:
                dist.destroy_process_group()
                collective.dispose([])
        self._store = None  # the TCPStore server (rank 0) stops with its last reference

    # ---------------------------------------------------------- detection
    def should_abort(self) -> bool:
        """True when the master says the current plan is broken (a member died,
        hung or failed) or published a plan without us; polled at most every
        ``abort_poll_s`` while a collective waits."""
        now = self._clock()
        if not self.active or now - self._last_abort_check < self.abort_poll_s:
            return False
        self._last_abort_check = now
        try:
            plan = self.comm.get_comm_plan(self._last_version)
        except ConnectionError:
            return False  # the master is briefly unreachable: keep waiting
        if plan.aborting:
            return True
        return bool(plan.ready) and int(plan.plan_version) != self._last_version

    def change_pending(self) -> bool:
        """True when the master is forming a plan other than ours (checked at most
        every ``check_interval_s``; the answer is False in between)."""
        now = self._clock()
        if now - self._last_check < self.check_interval_s:
            return False
        self._last_check = now
        plan = self.comm.get_comm_plan(self._last_version)
        return (not plan.ready) or int(plan.plan_version) != self._last_version
