"""The PS ledger sized by the live state (docs/scale.md): the compacted ledger
answers as the full one did, settle messages of an older generation never close
a task a rollback re-opened (checked on the parameters), and the wire rejects
malformed closed sets."""

from __future__ import annotations

import json
import random

import grpc
import pytest
import torch

from elasticdl.checkpoint import data_position as dp
from elasticdl.checkpoint.paths import version_dir
from elasticdl.common.intervals import IntervalSet
from elasticdl.common.ledger import AppliedLedger
from elasticdl.common.tables import dense_owner
from elasticdl.master import ps_rollback
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc
from elasticdl.ps import shard_checkpoint as shard_ckpt
from elasticdl.ps.push import GradientPush
from elasticdl.ps.servicer import parse_intervals
from elasticdl.ps.shard import PSShard, ShardConfig
from tests.fixtures.zoo.toy.count_records import CountUpdates
from tests.unit.ps_helpers import local_ps

N = 16     # records (ids 0..N-1)
MB = 2     # records per minibatch


class FullLedger:
    """The ledger as it was before compaction: every push, forever."""

    def __init__(self) -> None:
        self.log: list[tuple[int, int, int, int]] = []

    def seen(self, t: int, mb: int) -> bool:
        return any(e[:2] == (t, mb) for e in self.log)

    def entries(self, tasks) -> list[tuple[int, int, int, int]]:
        return [e for e in self.log if e[0] in tasks]


def test_compacted_ledger_answers_as_the_full_one_for_open_tasks_and_duplicates():
    rng = random.Random(5)
    led, ref = AppliedLedger(), FullLedger()
    closed = IntervalSet()
    version = 0
    for step in range(600):
        t, mb = rng.randrange(40), rng.randrange(1, 5)
        if not led.seen(t, mb):
            assert not ref.seen(t, mb) and t not in closed
            version += 1
            led.add(t, mb, 3, version)
            ref.log.append((t, mb, 3, version))
        else:   # a duplicate for the full ledger too, or a closed task
            assert ref.seen(t, mb) or t in closed
        if step % 50 == 49:   # the master closes tasks in order, with holes
            hi = step // 15
            closed = closed.union(IntervalSet([(0, hi)])).difference(IntervalSet([(hi - 3,
                                                                                   hi - 2)]))
            assert led.settle(-1, closed) is not None
            assert len(led) == sum(1 for e in ref.log if e[0] not in closed)
        open_tasks = [t for t in range(40) if t not in closed]
        assert list(led.entries(open_tasks[:3])) == ref.entries(open_tasks[:3])
    assert list(led.entries()) == [e for e in ref.log if e[0] not in closed]
    for t in range(40):   # seen: the full ledger's answer, or closed (a duplicate)
        for mb in range(1, 5):
            assert led.seen(t, mb) == (ref.seen(t, mb) or t in closed)
    # the checkpoint form round-trips, and holds only live entries + intervals
    state = led.state_dict()
    assert state["log"].shape[0] == len(led) < len(ref.log)
    again = AppliedLedger()
    again.load_state_dict(state)
    assert list(again.entries()) == list(led.entries()) and again.closed == led.closed
    assert again.applied_total == len(ref.log)
    # a checkpoint written before compaction (a full log, no closed set) still loads
    old = AppliedLedger()
    old.load_state_dict({"log": torch.tensor(ref.log, dtype=torch.int64).reshape(-1, 4)})
    assert list(old.entries()) == ref.log and not old.closed


def test_settle_of_an_older_generation_is_ignored():
    led = AppliedLedger()
    led.add(7, 1, 2, 1)
    led.generation = 10                       # rolled back: versions continue at 10
    assert led.settle(9, IntervalSet([(7, 8)])) is None
    assert led.seen(7, 1) and not led.seen(7, 2) and 7 not in led.closed
    assert led.settle(10, IntervalSet([(7, 8)])) == 1
    assert led.seen(7, 2) and len(led) == 0


@pytest.mark.parametrize("flat, error", [([1, 2, 3], "even length"),
                                         ([5, 6, 1, 2], "sorted"),
                                         ([4, 4], "non-empty"), ([3, 1], "non-empty")])
def test_malformed_closed_sets_are_rejected(flat, error):
    with pytest.raises(ValueError, match=error):
        parse_intervals(flat, "settle: closed")


def test_malformed_settle_is_invalid_argument_over_grpc():
    with local_ps(1) as cluster:
        with grpc.insecure_channel(cluster.addrs[0]) as channel:
            stub = pb_grpc.PServerStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.settle(pb.SettleRequest(generation=0, closed=[1, 2, 3]), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "even length" in err.value.details()
            resp = stub.settle(pb.SettleRequest(generation=0, closed=[1, 3]), timeout=10)
            assert resp.accepted
            status = stub.status(pb.Empty(), timeout=10)
            assert status.generation == 0 and status.closed_intervals == 1


# ----------------------------------------------------------------- on a real PS
def _count_shard(ckpt: str) -> PSShard:
    cfg = ShardConfig(ps_id=0, num_ps=1, checkpoint_dir=ckpt, minibatch_size=MB)
    shard = PSShard(cfg, lambda params: CountUpdates(params))
    shard.initialize(0, {"counts": torch.zeros(N)}, {}, [])
    return shard


def _push(shard: PSShard, task: int, mb: int) -> bool:
    """Minibatch ``mb`` (1-based) of task ``task``: records ``task*4 + 2*(mb-1) ..``
    (4 records per task); the gradient is 1 at those ids, so ``counts[i]`` counts
    the applies of record i. Returns whether it was a duplicate."""
    grad = torch.zeros(N)
    first = task * 2 * MB + (mb - 1) * MB
    grad[first:first + MB] = 1.0
    result = shard.push_gradients(GradientPush(version=shard.version, dense={"counts": grad},
                                               task_id=task, minibatch=mb, num_records=MB))
    assert result.accepted
    return result.duplicate


def test_a_stale_settle_after_a_rollback_does_not_close_a_reopened_task(tmp_path):
    ckpt = str(tmp_path)
    shard = _count_shard(ckpt)
    for mb in (1, 2):
        _push(shard, 0, mb)
    assert shard.settle(-1, IntervalSet([(0, 1)])) == 2     # task 0 closed and folded
    assert len(shard.ledger) == 0
    shard_ckpt.save_shard(shard, ckpt)                          # version 2, after compaction
    for mb in (1, 2):
        _push(shard, 1, mb)
    stale = IntervalSet([(0, 2)])     # the master closed task 1 before the rollback...
    vdir = version_dir(ckpt, 2)
    shard.rollback(lambda s: shard_ckpt.restore_shard(s, vdir), new_version=110)
    assert shard.ledger.closed == IntervalSet([(0, 1)]) and len(shard.ledger) == 0
    # ...and that message arrives after it: ignored, task 1 stays open
    assert shard.settle(-1, stale) is None
    assert not shard.ledger.seen(1, 1)
    assert not _push(shard, 1, 1) and not _push(shard, 1, 2)    # re-pushed: applied
    assert _push(shard, 0, 1)                                    # closed: a duplicate
    counts = shard.params.dense["counts"].detach()
    assert torch.equal(counts[:8], torch.ones(8)) and counts[8:].sum() == 0
    # the settle of the new generation closes it; its pushes are duplicates now
    assert shard.settle(110, IntervalSet([(0, 2)])) == 2
    assert _push(shard, 1, 2)
    assert torch.equal(shard.params.dense["counts"].detach()[:8], torch.ones(8))


def test_checkpoint_and_rollback_answer_carry_closed_intervals(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with local_ps(2, optimizer=lambda p: CountUpdates(p), checkpoint_dir=ckpt,
                  minibatch_size=MB) as cluster:
        for s in cluster.shards:
            s.initialize(0, {n: torch.zeros(N) for n in ("even", "odd")
                             if dense_owner(n, 2) == s.config.ps_id}, {}, [])
        for s in cluster.shards:
            name = next(iter(s.params.dense))
            for task, mbs in ((0, (1, 2)), (1, (1, 2)), (2, (1,))):
                for mb in mbs:
                    g = torch.zeros(N)
                    g[task * 4 + (mb - 1) * 2:task * 4 + mb * 2] = 1
                    s.push_gradients(GradientPush(version=s.version, dense={name: g},
                                                  task_id=task, minibatch=mb,
                                                  num_records=MB))
        cluster.shards[0].settle(-1, IntervalSet([(0, 2)]))   # PS 1 has not heard yet
        for s in cluster.shards:
            shard_ckpt.save_shard(s, ckpt)
        vdir = version_dir(ckpt, 5)
        # the data position: tasks 0, 1 whole (closed on PS 0, all entries on PS 1),
        # task 2's first minibatch
        trained = dp.read_trained(vdir)
        assert trained == {0: {0: 2, 2: 2}, 1: {0: 2, 2: 2}, 2: {0: 2}}
        with open(dp.trained_path(vdir, "ps-0-of-2")) as f:
            assert json.load(f)["closed"] == [0, 2]
        result = ps_rollback.rollback_all(cluster.addrs, 5, timeout_s=30)
        new_version, applied = result          # the two values callers unpack
        assert new_version > 5 and result.closed == IntervalSet()
        assert applied == {0: 4, 1: 4, 2: 2}
        for s in cluster.shards:
            s.settle(new_version, IntervalSet([(0, 3)]))
        for s in cluster.shards:
            shard_ckpt.save_shard(s, ckpt, version=new_version + 1)
        result = ps_rollback.rollback_all(cluster.addrs, new_version + 1, timeout_s=30)
        assert result.closed == IntervalSet([(0, 3)]) and result.applied == {}


def test_audit_trail_follows_the_restored_history(tmp_path):
    from elasticdl.ps.audit import AuditLog

    path = str(tmp_path / "ps-0-applied.bin")
    audit = AuditLog(path)
    for v in range(1, 11):
        audit.append(v, 1, 2, v)
    audit.truncate_after(6)                      # restored version 6: 7..10 go
    assert [e[3] for e in audit.entries()] == [1, 2, 3, 4, 5, 6]
    with open(path, "ab") as f:                  # a PS killed mid-write
        f.write(b"\x01\x02\x03")
    again = AuditLog(path)                       # its relaunch: the torn tail goes
    again.append(7, 1, 2, 7)
    assert [e[0] for e in again.entries()] == [1, 2, 3, 4, 5, 6, 7]
