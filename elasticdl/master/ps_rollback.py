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
while the PS restore (``--ps_recovery=rollback_all``).

With ``--ps_recovery=alone`` (:func:`restore_alone`) only the relaunched PS
restores ``V``; the others keep their state, and the work the restored PS
lacks is re-queued: each PS skips by its ledger what it holds, so only the
restored one applies it again. See docs/parameter_server.md#recovery.

Never imports torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Optional

import grpc

from elasticdl.checkpoint import paths as ckpt_paths
from elasticdl.checkpoint import staging
from elasticdl.common import auth
from elasticdl.common import ledger as ps_ledger
from elasticdl.common.intervals import IntervalSet
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

VERSION_SLACK = 100  # versions a PS may still apply between the status read and the rollback


def alone_slack(num_workers: int) -> int:
    """The slack of a lone restore's new version above every PS's current one.

    The restored PS must only never repeat its own earlier versions, and those are at
    most the others' current versions plus the pushes in flight to it when it died (a
    worker whose push to the lost PS fails stalls there: one each). The others are not
    rolled back, so their versions need no room. A small slack keeps the restored PS's
    numbering close to theirs: with ``VERSION_SLACK`` it ran ~100 versions ahead, and for
    those ~100 versions no new checkpoint directory could complete (a second PS lost
    meanwhile restored an older checkpoint, redoing more)."""
    return num_workers + 2


def newest_version(checkpoint_dir: str) -> Optional[int]:
    versions = ckpt_paths.complete_versions(checkpoint_dir) if checkpoint_dir else []
    return versions[-1] if versions else None


def held_by_every_ps(answers: Sequence[pb.AppliedResponse]
                     ) -> tuple[dict[int, int], IntervalSet]:
    """What every PS's restored ledger holds: per task not closed on all of them,
    the records of the minibatches each holds (live, or the task closed there),
    and the tasks closed on every PS (all their records held). O(live + closed
    intervals), whatever the job's length."""
    parts = [ps_ledger.held(IntervalSet.from_flat(list(resp.closed)),
                            ((p.task_id, p.minibatch, p.num_records) for p in resp.pushes))
             for resp in answers]
    closed, live = ps_ledger.common(parts)
    return {task: sum(mbs.values()) for task, mbs in live.items()}, closed


def applied_records(answers: Sequence[pb.AppliedResponse]) -> dict[int, int]:
    """Per task, the records whose pushes every PS's restored ledger holds (tasks
    closed on every PS: see :func:`held_by_every_ps`)."""
    return held_by_every_ps(answers)[0]


class RollbackResult(tuple):  # type: ignore[type-arg]
    """``(new_version, applied)`` as before (callers unpack two values), plus
    ``closed``: the tasks closed in every PS's restored ledger (fully held)."""

    closed: IntervalSet

    def __new__(cls, new_version: int, applied: dict[int, int],
                closed: IntervalSet) -> RollbackResult:
        out = super().__new__(cls, (new_version, applied))
        out.closed = closed
        return out

    @property
    def new_version(self) -> int:
        return int(self[0])

    @property
    def applied(self) -> dict[int, int]:
        return dict(self[1])


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
                  timeout_s: float = 120.0) -> tuple[dict[int, int], IntervalSet]:
    """Roll every PS back to checkpoint ``version`` (``version_dir``: the master's
    restore rule) continuing at ``new_version``; per task, the records every
    restored ledger holds, and the tasks every restored ledger holds closed (whole).
    The request carries ``(protocol_id, incarnation)``: a PS that did this very
    rollback answers as it did, without rolling back again.

    Raises:
        TimeoutError: a PS was not reachable within ``timeout_s``.
        grpc.RpcError: a PS refused (INVALID_ARGUMENT "must exceed": it is past
            ``new_version``; choose again).
    """
    channels = _channels(ps_addrs, time.monotonic() + timeout_s)
    try:
        request = pb.RollbackRequest(checkpoint_version=version, new_version=new_version,
                                     protocol_id=protocol_id, incarnation=incarnation,
                                     version_dir=staging.to_url(version_dir))
        answers = [pb_grpc.PServerStub(c).rollback(request, timeout=timeout_s)
                   for c in channels]
    finally:
        for c in channels:
            c.close()
    logger.warning("PS at %s rolled back to checkpoint version %d; versions continue at %d",
                   list(ps_addrs), version, new_version)
    return held_by_every_ps(answers)


def restore_alone(ps_addrs: Sequence[str], restore: Sequence[int], version: int,
                  new_version: int, *, protocol_id: int = 0, incarnation: int = 0,
                  version_dir: str = "", timeout_s: float = 120.0
                  ) -> tuple[dict[int, int], IntervalSet]:
    """``--ps_recovery=alone``: only the PS ``restore`` (relaunched, waiting) restore
    checkpoint ``version`` and continue at ``new_version``; the others keep their
    state and versions. Returns, per task, the records every restored ledger holds
    and the tasks every restored ledger holds whole (what the master re-queues
    beyond: the others hold it all, and skip its redo by their ledgers).

    First every other PS is told the new ledger generation (a ``settle`` of no
    tasks at ``new_version``): a worker's read of the ledgers counts as after the
    restore only when every PS it read answers ``new_version`` or above (the
    master's staleness rule, :func:`elasticdl.master.task_state.applied_short`);
    the restored PS answer so from their restore on, and the others need not
    wait for the master's next settle round to.

    Raises:
        TimeoutError / grpc.RpcError: as :func:`rollback_each`.
    """
    restore = sorted(set(restore))
    others = [a for i, a in enumerate(ps_addrs) if i not in restore]
    wait_s = min(timeout_s, 10.0)   # one that is gone joins the protocol meanwhile
    channels = _channels(others, time.monotonic() + wait_s)
    try:
        for c in channels:
            pb_grpc.PServerStub(c).settle(pb.SettleRequest(generation=new_version),
                                          timeout=wait_s)
    finally:
        for c in channels:
            c.close()
    held = rollback_each([ps_addrs[i] for i in restore], version, new_version,
                         protocol_id=protocol_id, incarnation=incarnation,
                         version_dir=version_dir, timeout_s=timeout_s)
    logger.warning("PS %s restored checkpoint version %d alone (versions continue at %d "
                   "there); PS %s keep their state", restore, version, new_version,
                   [i for i in range(len(ps_addrs)) if i not in restore])
    return held


def rollback_all(ps_addrs: Sequence[str], version: int, timeout_s: float = 120.0,
                 version_dir: str = "") -> RollbackResult:
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
            applied, closed = rollback_each(ps_addrs, version, new_version,
                                            version_dir=version_dir,
                                            timeout_s=max(1.0, deadline - time.monotonic()))
            return RollbackResult(new_version, applied, closed)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT and \
                    "must exceed" in (e.details() or "") and \
                    time.monotonic() < deadline:  # a PS moved on meanwhile: again
                continue
            raise
