"""PS recovery without mixing versions (the master's side).

When a PS dies, the master relaunches it with ``--await_rollback``: it
restores checkpoint version ``V`` of the job's checkpoint directory but serves
no training until told. The master then rolls *every* PS back to that same
``V`` (``rollback`` RPC: restore ``V``, discard pending sync groups, continue
numbering versions above any version a PS ever had, so numbers never repeat)
and re-queues exactly the work not contained in ``V``: the PS ledgers saved
with ``V`` say which ``(task, minibatch)`` pushes it holds (each PS answers
the rollback with its restored ledger). The cost: every PS loses the updates
after ``V`` (at most ``--checkpoint_steps`` versions), and training pauses
while the PS restore. See docs/parameter_server.md.

Never imports torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Optional

import grpc

from elasticdl.checkpoint import paths as ckpt_paths
from elasticdl.common import auth
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

VERSION_SLACK = 100  # versions a PS may still apply between the status read and the rollback


def newest_version(checkpoint_dir: str) -> Optional[int]:
    versions = ckpt_paths.complete_versions(checkpoint_dir) if checkpoint_dir else []
    return versions[-1] if versions else None


def applied_records(answers: Sequence[pb.AppliedResponse]) -> dict[int, int]:
    """Per task, the records whose pushes every PS's restored ledger holds."""
    ledgers: list[dict[int, dict[int, int]]] = []
    for resp in answers:
        led: dict[int, dict[int, int]] = {}
        for p in resp.pushes:
            led.setdefault(p.task_id, {})[p.minibatch] = p.num_records
        ledgers.append(led)
    out: dict[int, int] = {}
    for task in set.intersection(*(set(led) for led in ledgers)):
        common = set.intersection(*(set(led[task]) for led in ledgers))
        out[task] = sum(ledgers[0][task][mb] for mb in common)
    return out


def _channels(ps_addrs: Sequence[str], deadline: float) -> list[grpc.Channel]:
    channels = [auth.client_channel(a, replica="master") for a in ps_addrs]  # job token
    try:
        for i, channel in enumerate(channels):
            try:
                grpc.channel_ready_future(channel).result(
                    timeout=max(0.1, deadline - time.monotonic()))
            except grpc.FutureTimeoutError:
                raise TimeoutError(f"PS {i} at {ps_addrs[i]} not reachable for the "
                                   "rollback") from None
    except BaseException:
        for c in channels:
            c.close()
        raise
    return channels


def ps_versions(ps_addrs: Sequence[str], timeout_s: float = 30.0) -> list[int]:
    """Every PS's current model version.

    Raises:
        TimeoutError / grpc.RpcError: a PS did not answer.
    """
    channels = _channels(ps_addrs, time.monotonic() + timeout_s)
    try:
        return [pb_grpc.PServerStub(c).status(pb.Empty(), timeout=timeout_s).version
                for c in channels]
    finally:
        for c in channels:
            c.close()


def rollback_each(ps_addrs: Sequence[str], version: int, new_version: int, *,
                  protocol_id: int = 0, incarnation: int = 0, version_dir: str = "",
                  timeout_s: float = 120.0) -> dict[int, int]:
    """Roll every PS back to checkpoint ``version`` (``version_dir``: the master's
    restore rule) continuing at ``new_version``; per task, the records every
    restored ledger holds. The request carries ``(protocol_id, incarnation)``: a PS
    that did this very rollback answers as it did, without rolling back again.

    Raises:
        TimeoutError: a PS was not reachable within ``timeout_s``.
        grpc.RpcError: a PS refused (INVALID_ARGUMENT "must exceed": it is past
            ``new_version``; choose again).
    """
    channels = _channels(ps_addrs, time.monotonic() + timeout_s)
    try:
        request = pb.RollbackRequest(checkpoint_version=version, new_version=new_version,
                                     protocol_id=protocol_id, incarnation=incarnation,
                                     version_dir=version_dir)
        answers = [pb_grpc.PServerStub(c).rollback(request, timeout=timeout_s)
                   for c in channels]
    finally:
        for c in channels:
            c.close()
    logger.warning("every PS rolled back to checkpoint version %d; versions continue at %d",
                   version, new_version)
    return applied_records(answers)


def rollback_all(ps_addrs: Sequence[str], version: int, timeout_s: float = 120.0,
                 version_dir: str = "") -> tuple[int, dict[int, int]]:
    """Roll every PS back to checkpoint ``version``; returns the version numbering
    continues from (above every version any PS had) and, per task, the records
    the restored state holds. (One call; the master's protocol runs the steps
    apart: :mod:`elasticdl.master.executor`.)

    Raises:
        TimeoutError: a PS did not answer within ``timeout_s``.
        grpc.RpcError: a PS refused the rollback (e.g. the version is missing).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        current = ps_versions(ps_addrs, max(1.0, deadline - time.monotonic()))
        new_version = max(current + [version]) + 1 + VERSION_SLACK
        try:
            return new_version, rollback_each(ps_addrs, version, new_version,
                                              version_dir=version_dir,
                                              timeout_s=max(1.0, deadline - time.monotonic()))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT and \
                    "must exceed" in (e.details() or "") and \
                    time.monotonic() < deadline:  # a PS moved on meanwhile: again
                continue
            raise
