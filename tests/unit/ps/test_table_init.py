"""PS tables that start from explicit rows: EmbeddingTable, the chunked push_model
(worker and PS sides over real gRPC in this process), one winner, stale pushes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elasticdl.checkpoint import ps_shards
from elasticdl.common.tables import TableSpec
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.ps import shard_checkpoint as shard_ckpt
from elasticdl.ps.model_push import ModelPushes
from elasticdl.ps.parameters import EmbeddingTable
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
            # and restores, into the same or another number of PS
            for new_num_ps in (1, 3):
                restored = PSShard(ShardConfig(ps_id=new_num_ps - 1, num_ps=new_num_ps), sgd())
                shard_ckpt.restore_shard(restored, vdir)
                table = restored.params.tables["emb.weight"]
                mine = np.arange(new_num_ps - 1, N, new_num_ps)
                assert table.spec.explicit and table.size == mine.shape[0]
                assert torch.equal(table.lookup(mine, create=False), weight[mine])
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


OPTIONS_MODULE = '''
import torch
from torch import nn

from elasticdl.api.layers import Embedding


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.freq = Embedding(50, 3, padding_idx=2, scale_grad_by_freq=True)
        self.sparse = Embedding(50, 3, sparse=True)
        self.fc = nn.Linear(6, 1)

    def forward(self, ids):
        return self.fc(torch.cat([self.freq(ids).sum(1), self.sparse(ids).sum(1)], 1))[:, 0]


def custom_model():
    return Model()


def loss(labels, outputs):
    return ((outputs - labels) ** 2).mean()


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def feed(records, mode):
    return records, None
'''


def test_ps_step_equals_local_step_with_scale_grad_by_freq_sparse_and_padding(tmp_path):
    from elasticdl.api.model_spec import load_model_spec
    from elasticdl.common.job_spec import JobSpec
    from elasticdl.worker.ps_trainer import PSTrainer
    from elasticdl.worker.trainer import LocalTrainer

    pkg = tmp_path / "zoo" / "emb_options"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(OPTIONS_MODULE)
    zoo, model_def = str(tmp_path / "zoo"), "emb_options.model.custom_model"
    spec = load_model_spec(zoo, model_def)
    job = JobSpec(model_zoo=zoo, model_def=model_def, training_data="unused",
                  distribution_strategy="ParameterServerStrategy", num_ps_pods=2, seed=4)
    ids = torch.tensor([[1, 1, 1, 7], [7, 2, 2, 9], [1, 9, 3, 3]])  # repeats, padding id 2
    labels = torch.tensor([1.0, -1.0, 0.5])
    local = LocalTrainer(spec, torch.device("cpu"), seed=job.seed)
    before = {k: v.clone() for k, v in local.model.state_dict().items()}
    local.train_minibatch(ids, labels)
    with local_ps(2, optimizer=sgd(0.1)) as cluster:
        client = PSClient(cluster.addrs, rpc_timeout_s=30)
        trainer = PSTrainer(spec, cluster.addrs, job, 0, torch.device("cpu"), client=client,
                            init_timeout_s=30)
        try:
            for name in ("freq.weight", "sparse.weight"):  # same start
                assert torch.equal(client.pull_embedding_unique(
                    name, np.arange(50), 3, torch.float32, create=False), before[name])
            trainer.train_minibatch(ids, labels)
            for name in ("freq.weight", "sparse.weight"):
                rows = client.pull_embedding_unique(name, np.arange(50), 3, torch.float32,
                                                    create=False)
                want = local.model.state_dict()[name]
                assert torch.allclose(rows, want, atol=1e-6, rtol=0), name
                assert not torch.equal(rows, before[name]), name
            assert torch.equal(client.pull_embedding_unique(
                "freq.weight", np.array([2]), 3, torch.float32, create=False),
                before["freq.weight"][2:3])  # the padding row is never updated
        finally:
            trainer.close()


def test_a_ps_restarted_without_checkpoint_gets_lazy_tables_with_the_initial_std(tmp_path):
    """The initial rows were dropped after the first push: a PS that lost its model is
    re-initialised by a worker with lazy tables (normal, the std of the initial rows)."""
    from elasticdl.api.model_spec import load_model_spec
    from elasticdl.common.job_spec import JobSpec
    from elasticdl.ps.server import start_server
    from elasticdl.ps.servicer import PServicer
    from elasticdl.worker.ps_trainer import PSTrainer

    pkg = tmp_path / "zoo" / "emb_restart"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(OPTIONS_MODULE.replace(
        "self.fc = nn.Linear(6, 1)",
        "self.fc = nn.Linear(6, 1)\n        nn.init.normal_(self.freq.weight, std=0.01)"))
    zoo, model_def = str(tmp_path / "zoo"), "emb_restart.model.custom_model"
    spec = load_model_spec(zoo, model_def)
    job = JobSpec(model_zoo=zoo, model_def=model_def, training_data="unused",
                  distribution_strategy="ParameterServerStrategy", num_ps_pods=1, seed=4)
    ids, labels = torch.tensor([[1, 5], [7, 9]]), torch.tensor([1.0, 0.0])
    with local_ps(1, optimizer=sgd(0.1)) as cluster:
        client = PSClient(cluster.addrs, rpc_timeout_s=30, reconnect_timeout_s=30)
        trainer = PSTrainer(spec, cluster.addrs, job, 0, torch.device("cpu"), client=client,
                            init_timeout_s=30)
        try:
            assert trainer._initial_rows == {}  # dropped once the PS held the model
            trainer.train_minibatch(ids, labels)
            cluster.stop(0)  # the PS dies and comes back empty on the same port
            fresh = PSShard(ShardConfig(ps_id=0, num_ps=1), sgd(0.1))
            server, _ = start_server(PServicer(fresh), cluster.ports[0], "127.0.0.1")
            cluster.servers[0] = server
            trainer.train_minibatch(ids, labels)
            table = fresh.params.tables["freq.weight"]
            assert not table.spec.explicit and table.spec.initializer.startswith("normal:")
            assert 0.005 < float(table.spec.initializer.split(":")[1]) < 0.02
            # the worker held the parameters of version 1 (the first push's answer brought
            # them): it re-initialised the PS at 1, and its step made 2
            assert fresh.version == 2
        finally:
            trainer.close()
