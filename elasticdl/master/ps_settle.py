"""The master's settle sender: tells every PS which tasks are closed, and settles
what complete checkpoints hold (docs/scale.md).

A thread of the master (ParameterServerStrategy) that, every ``interval_s``:

* sends ``settle(generation, closed)`` — :meth:`JobCore.closed_tasks` — to every
  PS when it changed since that PS last accepted it (and at least every
  ``resend_s``, for a PS relaunched meanwhile). The PS folds its ledger
  entries of those tasks into its closed interval set, so its ledger stays
  O(live). Each call has a bounded timeout; a PS that is down or relaunching is
  retried next round, never waited for.
* notices a new complete checkpoint version ``V`` and calls
  :meth:`JobCore.settle` with the tasks every PS's ``trained-ps-*.json`` of
  ``V`` records as closed: those are in ``V`` on every PS, so no rollback can
  undo them any more.

Never imports torch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional

import grpc

from elasticdl.checkpoint import data_position
from elasticdl.checkpoint import paths as ckpt_paths
from elasticdl.common import auth
from elasticdl.common.intervals import IntervalSet
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


# the snapshot's age bound; the environment sets it only to drive the staleness in tests
CLOSED_MAX_AGE_ENV = "ELASTICDL_CLOSED_MAX_AGE_S"


class ClosedSnapshot:
    """:meth:`JobCore.closed_tasks` as ``(generation, flat intervals)``, refreshed at
    most every ``max_age_s`` (what the servicer attaches to allreduce tasks: a copy of
    the interval set per call would cost O(intervals) on every lease). Members may
    so learn a set up to ``max_age_s`` old; the export order carries a fresh one."""

    def __init__(self, core: Any, max_age_s: Optional[float] = None):
        self.core = core
        if max_age_s is None:
            max_age_s = float(os.environ.get(CLOSED_MAX_AGE_ENV, "1.0"))
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._value: tuple[int, list[int]] = (-1, [])
        self._at = -1e18

    def get(self) -> tuple[int, list[int]]:
        with self._lock:
            if time.monotonic() - self._at >= self.max_age_s:
                generation, closed = self.core.closed_tasks()
                self._value, self._at = (generation, closed.to_flat()), time.monotonic()
            return self._value


def held_by_checkpoint(version_dir: str) -> Optional[IntervalSet]:
    """Tasks closed in every PS's ``trained-ps-*.json`` of a complete version
    directory; None when it has no such files (no data position written)."""
    found = data_position.read_trained_set(version_dir)
    return None if found is None else found.closed


class Settler:
    """The settle thread (see the module docs).

    Args:
        core: the :class:`JobCore` (``closed_tasks`` and ``settle``).
        ps_addrs: the PS endpoints (the list the job controller keeps; read each round).
        checkpoint_dir: the job's checkpoint directory ("" when it writes none).
    """

    def __init__(self, core: Any, ps_addrs: Sequence[str], checkpoint_dir: str = "",
                 interval_s: float = 2.0, rpc_timeout_s: float = 5.0, resend_s: float = 30.0):
        self.core = core
        self.ps_addrs = ps_addrs
        self.checkpoint_dir = checkpoint_dir
        self.interval_s = interval_s
        self.rpc_timeout_s = rpc_timeout_s
        self.resend_s = resend_s
        self.settled_version = -1       # newest checkpoint version settled
        self.sent = 0                   # settle messages a PS accepted
        self._last: dict[str, tuple[int, list[int], float]] = {}  # addr -> what, when
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.PServerStub]] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> Settler:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="ps-settle")
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for channel, _ in self._channels.values():
            channel.close()
        self._channels = {}

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except (OSError, ckpt_paths.CheckpointError) as e:   # a torn file: next round
                logger.warning("settle round failed: %s", e)

    # ---------------------------------------------------------------- round
    def run_once(self) -> int:
        """One round: settle messages to every PS, then a new complete checkpoint.
        Returns how many PS accepted a message this round."""
        generation, closed = self.core.closed_tasks()
        flat = closed.to_flat()
        accepted = 0
        for addr in list(self.ps_addrs):
            last = self._last.get(addr)
            if last is not None and last[0] == generation and last[1] == flat and \
                    time.monotonic() - last[2] < self.resend_s:
                continue
            if self._send(addr, generation, flat):
                self._last[addr] = (generation, flat, time.monotonic())
                accepted += 1
        self.sent += accepted
        self._settle_checkpoint()
        return accepted

    def _stub(self, addr: str) -> pb_grpc.PServerStub:
        if addr not in self._channels:
            channel = auth.client_channel(addr, replica="master")
            self._channels[addr] = (channel, pb_grpc.PServerStub(channel))
        return self._channels[addr][1]

    def _send(self, addr: str, generation: int, flat: list[int]) -> bool:
        try:
            resp = self._stub(addr).settle(pb.SettleRequest(generation=generation, closed=flat),
                                           timeout=self.rpc_timeout_s)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            # a PS starting or relaunching is UNAVAILABLE for a while: not news
            log = logger.debug if code == grpc.StatusCode.UNAVAILABLE else logger.warning
            log("settle to PS %s not delivered (%s); retried next round", addr, code or e)
            return False
        if not resp.accepted:
            logger.info("PS %s ignored settle of generation %d (it is at %d, or waits for "
                        "its rollback)", addr, generation, resp.generation)
            return False
        logger.debug("PS %s settled: %d entries folded, %d live", addr, resp.folded,
                     resp.live_pushes)
        return True

    def _settle_checkpoint(self) -> None:
        if not self.checkpoint_dir:
            return
        versions = ckpt_paths.complete_versions(self.checkpoint_dir)
        if not versions or versions[-1] <= self.settled_version:
            return
        version = versions[-1]
        held = held_by_checkpoint(ckpt_paths.version_dir(self.checkpoint_dir, version))
        self.settled_version = version
        if held is None:
            return
        settled = self.core.settle(version, held)
        logger.info("checkpoint version %d holds %d closed task(s) on every PS: settled %d",
                    version, len(held), settled)


def start(core: Any, ps_addrs: Sequence[str], checkpoint_dir: str = "",
          **kwargs: Any) -> Optional[Settler]:
    """Start a settle thread when the job has PS (None otherwise)."""
    if not ps_addrs:
        return None
    return Settler(core, ps_addrs, checkpoint_dir, **kwargs).start()
