"""PS tables that start from explicit rows: EmbeddingTable, the chunked push_model
(worker and PS sides over real gRPC in this process), one winner, stale pushes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elasticdl.checkpoint import ps_shards
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.ps.model_push import ModelPushes
from elasticdl.ps.parameters import EmbeddingTable, TableSpec
from elasticdl.ps.shard import PSShard, ShardConfig
from elasticdl.worker.ps_client import PSClient
from elasticdl.worker.ps_model_push import model_messages, push_model
from tests.unit.ps_helpers import local_ps, sgd

N, DIM = 10_001, 16


def _spec(**kw) -> TableSpec:
    return TableSpec(name="emb.weight", num_embeddings=N, dim=DIM, explicit=True, **kw)


def test_explicit_table_holds_exactly_the_given_rows():
    weight = torch.randn(N, DIM)
    table = EmbeddingTable(_spec(rows=weight[1::3].contiguous()), ps_id=1, num_ps=3)
    assert table.spec.rows is None and table.size == len(range(1, N, 3))
    ids = np.array([1, 4, 10000, 7, 1])
    assert torch.equal(table.lookup(ids, create=False), weight[ids])
    assert torch.equal(table.lookup(ids), weight[ids])
    with pytest.raises(ValueError, match="expects initial rows"):
        EmbeddingTable(_spec(rows=weight[:5]), ps_id=0, num_ps=3)
    empty = EmbeddingTable(_spec(), ps_id=0, num_ps=1)  # restored from a checkpoint next
    with pytest.raises(ValueError, match="explicit rows"):
        empty.lookup(np.array([3]))


def test_messages_stay_under_the_chunk_size_and_cover_every_row():
    weight = torch.randn(N, DIM)
    msgs = list(model_messages(4, {"w": torch.ones(3)}, {}, [_spec()], {"emb.weight": weight},
                               ps=1, num_ps=2, chunk_bytes=64 << 10))
    assert len(msgs) == 5 and msgs[0].part == 0 and msgs[-1].last
    assert len({m.init_id for m in msgs}) == 1 and msgs[0].init_id != 0
    assert [m.part for m in msgs] == list(range(len(msgs)))
    assert all(sum(len(c.content) for c in m.table_rows) <= 64 << 10 for m in msgs)
    assert sum(len(c.content) for m in msgs for c in m.table_rows) == (N // 2) * DIM * 4
    assert msgs[0].embedding_tables[0].rows_pushed and len(msgs[0].dense) == 1
    assert not any(m.dense for m in msgs[1:])


@pytest.mark.parametrize("num_ps", [1, 2])
def test_push_model_over_grpc_starts_tables_from_the_pushed_rows(num_ps, tmp_path):
    torch.manual_seed(0)
    weight = torch.nn.init.xavier_uniform_(torch.empty(N, DIM))
    lazy = TableSpec(name="lazy.weight", num_embeddings=50, dim=2, initializer="zeros")
    ckpt = str(tmp_path / "ckpt")
    with local_ps(num_ps, checkpoint_dir=ckpt) as cluster:
        client = PSClient(cluster.addrs, rpc_timeout_s=30, chunk_bytes=64 << 10)
        try:
            took = push_model(client, 0, {"w": torch.ones(3)}, {}, [_spec(), lazy],
                              {"emb.weight": weight})
            assert took == [True] * num_ps
            assert push_model(client, 0, {"w": torch.ones(3)}, {}, [_spec(), lazy],
                              {"emb.weight": weight}) == [False] * num_ps
            rows = client.pull_embedding_unique("emb.weight", np.arange(N), DIM,
                                                torch.float32, create=False)
            assert torch.equal(rows, weight)  # bitwise
            assert torch.equal(client.pull_embedding_unique(
                "lazy.weight", np.arange(50), 2, torch.float32, create=False),
                torch.zeros(50, 2))
            # the checkpoint's export writes the table exactly
            client.save_checkpoint()
            vdir = ps_shards.version_dir_of(ckpt, 0)
            assert torch.equal(ps_shards.export_state_dict(vdir)["emb.weight"], weight)
        finally:
            client.close()


def _shard() -> PSShard:
    return PSShard(ShardConfig(ps_id=0, num_ps=1), sgd())


def test_one_push_wins_a_second_waits_and_a_silent_one_is_taken_over():
    weight = torch.randn(N, DIM)
    a = list(model_messages(0, {}, {}, [_spec()], {"emb.weight": weight}, 0, 1, 64 << 10))
    b = list(model_messages(0, {}, {}, [_spec()], {"emb.weight": 2 * weight}, 0, 1, 64 << 10))
    shard = _shard()
    pushes = ModelPushes(shard, stale_after_s=3600)
    assert pushes.push(a[0]) and pushes.push(a[1])
    assert pushes.push(a[1])                      # a resent part (answer lost) is harmless
    assert not pushes.push(b[0])                  # another push is under way
    assert all(pushes.push(m) for m in a[2:])     # the last part: the model is taken
    assert shard.initialized and not pushes.push(b[0])
    assert torch.equal(shard.params.tables["emb.weight"].lookup(np.arange(N)), weight)

    shard = _shard()
    pushes = ModelPushes(shard, stale_after_s=0.0)  # every pause counts as the sender died
    assert pushes.push(a[0]) and pushes.push(a[1])
    assert pushes.push(b[0])                      # a's push went silent: b starts over
    assert not pushes.push(a[2])                  # a learns it lost; it will retry whole
    for m in b[1:]:
        assert pushes.push(m)
    assert torch.equal(shard.params.tables["emb.weight"].lookup(np.arange(N)), 2 * weight)


def test_malformed_pushes_are_refused_and_leave_the_ps_empty():
    weight = torch.randn(N, DIM)
    msgs = list(model_messages(0, {}, {}, [_spec()], {"emb.weight": weight}, 0, 1, 64 << 10))
    shard = _shard()
    pushes = ModelPushes(shard, stale_after_s=3600)
    pushes.push(msgs[0])
    with pytest.raises(ValueError, match="part 2, expected 1"):
        pushes.push(msgs[2])
    assert not shard.initialized
    truncated = pb.Model()
    truncated.CopyFrom(msgs[0])
    truncated.last = True
    with pytest.raises(ValueError, match="incomplete"):
        ModelPushes(shard).push(truncated)
    with pytest.raises(ValueError, match="no initial rows"):
        list(model_messages(0, {}, {}, [_spec()], {}, 0, 1))
    assert not shard.initialized
