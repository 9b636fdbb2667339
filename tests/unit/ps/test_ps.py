"""The PS servicer in-process over gRPC on 127.0.0.1: model, pulls, pushes,
sync/async semantics, validation, embedding rows and row optimizers."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import torch

from elasticdl.common import tensor_codec as codec
from elasticdl.common.tables import TableSpec, dense_owner
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc
from elasticdl.ps.embedding_optimizer import row_optimizer_for
from elasticdl.ps.parameters import EmbeddingTable
from elasticdl.ps.shard import GradientPush, PSShard, ShardConfig
from elasticdl.worker.ps_client import PSClient, PSNotInitializedError
from tests.unit.ps_helpers import local_ps, sgd

W = torch.arange(6, dtype=torch.float32).reshape(2, 3)
B = torch.tensor([0.5, -0.5])
TABLE = TableSpec(name="emb.weight", num_embeddings=100, dim=4, initializer="normal:0.1",
                  seed=7)


def _client(cluster, **kw) -> PSClient:
    kw = {"rpc_timeout_s": 60.0, "reconnect_timeout_s": 5.0, **kw}  # generous: loaded CI
    client = PSClient(cluster.addrs, **kw)
    client.wait_ready(10)
    return client


def _init(client: PSClient, tables=(TABLE,)) -> None:
    assert all(client.push_model(0, {"w": W, "b": B}, {"steps": torch.tensor(0)},
                                 list(tables)))


def _pull(client: PSClient, streaming: bool, version: int = -1):
    dest = {"w": torch.zeros(2, 3), "b": torch.zeros(2), "steps": torch.tensor(-1)}
    res = client.pull_dense([version] * client.num_ps, dest, [streaming] * client.num_ps)
    return res, dest


@pytest.mark.parametrize("streaming", [False, True])
def test_push_model_then_pull(streaming):
    with local_ps(2) as cluster:
        client = _client(cluster, chunk_bytes=8)
        try:
            assert [s.initialized for s in client.status()] == [False, False]
            _init(client)
            assert client.push_model(0, {"w": W, "b": B}, {}, []) == [False, False]
            res, dest = _pull(client, streaming)
            assert all(init and version == 0 and changed for init, version, changed
                       in res.values())
            assert torch.equal(dest["w"], W) and torch.equal(dest["b"], B)
            assert int(dest["steps"]) == 0
            assert set(cluster.shards[dense_owner("w", 2)].params.dense) >= {"w"}
            res, _ = _pull(client, streaming, version=0)  # current: nothing sent
            assert not any(changed for _, _, changed in res.values())
        finally:
            client.close()


def _push(client, grads, version=0, worker_id=0, ps=0):
    return client.push_gradients(ps, version, grads, worker_id=worker_id).result()


def test_sync_waits_for_grads_to_wait_and_averages():
    with local_ps(1, sgd(0.1), grads_to_wait=2, sync_wait_s=10) as cluster:
        client = _client(cluster)
        try:
            _init(client)
            g1 = {"w": torch.ones(2, 3), "b": torch.ones(2)}
            g2 = {"w": 3 * torch.ones(2, 3), "b": -torch.ones(2)}
            f1 = client.push_gradients(0, 0, g1, worker_id=1)
            f2 = client.push_gradients(0, 0, g2, worker_id=2)
            assert f1.result() == (True, 1) and f2.result() == (True, 1)
            _, dest = _pull(client, False)
            assert torch.allclose(dest["w"], W - 0.1 * 2.0)
            assert torch.allclose(dest["b"], B)
            # too old for tolerance 0: rejected, nothing changes
            assert _push(client, g1, version=0) == (False, 1)
            assert cluster.shards[0].version == 1
        finally:
            client.close()


def test_sync_version_tolerance_accepts_slightly_stale():
    with local_ps(1, sgd(0.1), sync_version_tolerance=1) as cluster:
        client = _client(cluster)
        try:
            _init(client)
            g = {"w": torch.ones(2, 3)}
            assert _push(client, g, version=0) == (True, 1)
            assert _push(client, g, version=0) == (True, 2)   # 1 behind: ok
            assert _push(client, g, version=0) == (False, 2)  # 2 behind: rejected
        finally:
            client.close()


def test_sync_lone_worker_stops_waiting_after_timeout():
    with local_ps(1, sgd(0.1), grads_to_wait=2, sync_wait_s=0.3,
                  sync_wait_min_s=0.1) as cluster:
        client = _client(cluster)
        try:
            _init(client)
            g = {"w": torch.ones(2, 3)}
            # waited 0.3 s, then the incomplete group was applied (issue 10 item 2:
            # it used to stay pending, acknowledged but never applied)
            assert _push(client, g) == (True, 1)
            start = time.monotonic()
            assert _push(client, g, version=1) == (True, 2)  # peers absent: no waiting
            assert time.monotonic() - start < 0.2
        finally:
            client.close()


def test_sync_wait_adapts_to_the_usual_group_spread():
    with local_ps(1, sgd(0.1), grads_to_wait=2, sync_wait_s=20,
                  sync_wait_min_s=0.2) as cluster:
        client = _client(cluster)
        try:
            _init(client)
            g = {"w": torch.ones(2, 3)}
            for step in range(3):  # two workers in lockstep: groups complete at once
                futures = [client.push_gradients(0, step, g, worker_id=w) for w in (1, 2)]
                assert [f.result() for f in futures] == [(True, step + 1)] * 2
            start = time.monotonic()
            assert _push(client, g, version=3, worker_id=1) == (True, 4)  # partner gone
            assert 0.15 < time.monotonic() - start < 5  # ~sync_wait_min_s, not 20 s
        finally:
            client.close()


def test_async_applies_each_push_with_staleness_modulation():
    with local_ps(1, sgd(0.1), use_async=True, lr_staleness_modulation=True) as cluster:
        client = _client(cluster)
        try:
            _init(client)
            g = {"w": torch.ones(2, 3)}
            assert _push(client, g, version=0) == (True, 1)
            assert _push(client, g, version=0) == (True, 2)  # staleness 1: full lr
            assert _push(client, g, version=0) == (True, 3)  # staleness 2: lr / 2
            _, dest = _pull(client, False)
            assert torch.allclose(dest["w"], W - 0.1 - 0.1 - 0.05)
        finally:
            client.close()


def _stub(cluster, i=0) -> pb_grpc.PServerStub:
    return pb_grpc.PServerStub(grpc.insecure_channel(cluster.addrs[i]))


@pytest.mark.parametrize("tensor, match", [
    (codec.encode(torch.ones(2, 3), "nope"), "unknown parameter 'nope'"),
    (codec.encode(torch.ones(3, 2), "w"), "shape"),
    (codec.encode(torch.ones(2, 3, dtype=torch.float64), "w"), "dtype"),
    (pb.Tensor(name="w", dtype="float32", shape=[2, 3], content=b"123"), "content bytes"),
])
def test_bad_gradients_are_invalid_argument_and_ps_keeps_serving(tensor, match):
    with local_ps(1) as cluster:
        client = _client(cluster)
        try:
            _init(client)
            stub = _stub(cluster)
            with pytest.raises(grpc.RpcError) as err:
                stub.push_gradients(pb.PushGradientsRequest(version=0, dense=[tensor]),
                                    timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert match.split("'")[0] in err.value.details()
            # the chunked path validates too
            chunk = pb.TensorChunk(name=tensor.name, dtype=tensor.dtype, shape=tensor.shape,
                                   offset=0, total_bytes=len(tensor.content),
                                   content=tensor.content)
            with pytest.raises(grpc.RpcError) as err:
                stub.push_gradient_chunks(iter([pb.GradientChunk(dense=chunk)]), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            stub.echo(pb.Empty(), timeout=5)
            assert cluster.shards[0].version == 0
            assert _push(client, {"w": torch.ones(2, 3)}) == (True, 1)
        finally:
            client.close()


def test_bad_sparse_and_pull_requests_are_invalid_argument():
    with local_ps(2) as cluster:
        client = _client(cluster)
        try:
            _init(client)
            with pytest.raises(ValueError, match="unknown embedding table"):
                client.pull_embedding("nope", np.array([1]), 4)
            with pytest.raises(ValueError, match="out of range"):
                client.pull_embedding(TABLE.name, np.array([100]), 4)
            stub = _stub(cluster, 0)
            with pytest.raises(grpc.RpcError, match="belongs to PS 1"):
                stub.pull_embedding(pb.PullEmbeddingRequest(table=TABLE.name, ids=[3]))
            rows = pb.EmbeddingRows(table=TABLE.name, ids=[2],
                                    values=codec.encode(torch.ones(1, 3)))
            with pytest.raises(grpc.RpcError, match="shape") as err:
                stub.push_gradients(pb.PushGradientsRequest(sparse=[rows]), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert client.pull_embedding(TABLE.name, np.array([2, 3]), 4).shape == (2, 4)
        finally:
            client.close()


def test_push_before_model_is_failed_precondition():
    with local_ps(1) as cluster:
        client = _client(cluster)
        try:
            with pytest.raises(PSNotInitializedError):
                _push(client, {"w": torch.ones(2, 3)})
        finally:
            client.close()


def test_chunked_push_equals_unary_push():
    with local_ps(1, sgd(0.5)) as cluster:
        client = _client(cluster, chunk_bytes=5)
        try:
            _init(client)
            stream = client.open_push_stream(0, version=0, worker_id=3)
            stream.put_dense("w", torch.full((2, 3), 2.0))
            stream.put_sparse(TABLE.name, np.array([4, 9]), torch.ones(2, 4))
            stream.put_buffer("steps", torch.tensor(5))
            assert stream.finish() == (True, 1)
            _, dest = _pull(client, True)
            assert torch.allclose(dest["w"], W - 1.0) and int(dest["steps"]) == 5
            table = cluster.shards[0].params.tables[TABLE.name]
            assert torch.allclose(table.lookup(np.array([4, 9])),
                                  TABLE.initial_rows(np.array([4, 9])) - 0.5)
        finally:
            client.close()


def test_embedding_rows_lazy_deterministic_and_deduplicated():
    with local_ps(2) as cluster:
        client = _client(cluster)
        try:
            _init(client)
            assert [s.params.tables[TABLE.name].size for s in cluster.shards] == [0, 0]
            ids = np.array([[5, 8, 5], [99, 8, 0]])
            rows = client.pull_embedding(TABLE.name, ids, 4)
            assert rows.shape == (2, 3, 4)
            expected = TABLE.initial_rows(ids.reshape(-1)).reshape(2, 3, 4)
            assert torch.equal(rows, expected)
            assert [s.params.tables[TABLE.name].size for s in cluster.shards] == [2, 2]
            # evaluation pulls (no_create) return initial values and create nothing
            fresh = client.pull_embedding(TABLE.name, np.array([7, 8, 10]), 4, create=False)
            assert torch.equal(fresh, TABLE.initial_rows(np.array([7, 8, 10])))
            assert [s.params.tables[TABLE.name].size for s in cluster.shards] == [2, 2]
            # created once: a second pull returns the same rows without new slots
            assert torch.equal(client.pull_embedding(TABLE.name, ids, 4), expected)
            assert [s.params.tables[TABLE.name].size for s in cluster.shards] == [2, 2]
            # duplicate ids in one push are summed
            sparse = [(TABLE.name, np.array([8, 8]), torch.ones(2, 4))]
            assert client.push_gradients(0, 0, {}, sparse).result() == (True, 1)
            after = client.pull_embedding(TABLE.name, np.array([8]), 4)
            assert torch.allclose(after, expected[0, 1] - 0.1 * 2)
        finally:
            client.close()


OPTIMIZERS = [
    lambda p: torch.optim.SGD(p, lr=0.1),
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, weight_decay=0.01,
                                  initial_accumulator_value=0.1),
    lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.01),   # (no per-row step kept)
    lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01),
    lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.9), amsgrad=True),
    lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
]


@pytest.mark.parametrize("make", OPTIMIZERS)
def test_row_optimizer_matches_torch_dense(make):
    ids = np.array([3, 10, 42, 77], dtype=np.int64)
    shard = PSShard(ShardConfig(), make)
    shard.initialize(0, {}, {}, [TABLE])
    reference = torch.nn.Parameter(TABLE.initial_rows(ids))
    opt = make([reference])
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        grad = torch.randn(len(ids), 4, generator=gen)
        perm = np.random.default_rng(step).permutation(len(ids))  # order must not matter
        shard.push_gradients(GradientPush(version=step, sparse=[
            (TABLE.name, ids[perm], grad[torch.from_numpy(perm)].clone())]))
        reference.grad = grad
        opt.step()
    got = shard.pull_embedding(TABLE.name, ids)
    assert torch.allclose(got, reference.detach(), atol=1e-6, rtol=0), \
        (got - reference).abs().max()
    table = shard.params.tables[TABLE.name]
    row = row_optimizer_for(make([torch.nn.Parameter(torch.zeros(1))]))
    if row.uses_step():
        assert float(table.state["step"][:table.size].min()) == 6
    else:   # plain SGD, Adagrad without lr_decay: no update count a row (8 B saved)
        assert "step" not in table.state


def test_row_optimizer_rejects_unsupported():
    opt = torch.optim.RMSprop([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match="RMSprop"):
        row_optimizer_for(opt)


def test_table_grows_and_keeps_rows():
    table = EmbeddingTable(TableSpec("t", 10_000, 3, seed=1), ps_id=1, num_ps=3, capacity=2)
    ids = np.arange(1, 10_000, 3)
    first = table.lookup(ids[:5]).clone()
    table.lookup(ids)
    assert table.size == ids.shape[0]
    assert torch.equal(table.lookup(ids[:5]), first)
    assert torch.equal(first, TableSpec("t", 10_000, 3, seed=1).initial_rows(ids[:5]))


def test_concurrent_pulls_and_pushes_stay_consistent():
    with local_ps(1, sgd(0.01), use_async=True) as cluster:
        client = _client(cluster)
        try:
            _init(client)
            errors: list[BaseException] = []

            def work(k: int) -> None:
                try:
                    for _ in range(10):
                        _push(client, {"w": torch.ones(2, 3)}, worker_id=k)
                        _pull(client, k % 2 == 0)
                except BaseException as e:  # noqa: BLE001 - reported by the assert below
                    errors.append(e)

            threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not errors
            _, dest = _pull(client, False)
            assert torch.allclose(dest["w"], W - 0.01 * 40, atol=1e-5)
            assert cluster.shards[0].version == 40
        finally:
            client.close()


def test_client_reconnects_to_a_restarted_ps_and_gives_up_in_time():
    with local_ps(1) as cluster:
        client = _client(cluster, reconnect_timeout_s=2.0)
        try:
            _init(client)
            port = cluster.ports[0]
            cluster.stop(0)
            restarted = {}

            def restart() -> None:
                from elasticdl.ps.server import start_server
                from elasticdl.ps.servicer import PServicer

                shard = PSShard(ShardConfig(), sgd())
                restarted["server"], _ = start_server(PServicer(shard), port, "127.0.0.1")

            timer = threading.Timer(0.5, restart)
            timer.start()
            try:
                statuses = client.status()  # waits for the PS to come back
                assert statuses[0].initialized is False
            finally:
                timer.join(60)
                restarted["server"].stop(0).wait(5)
            with pytest.raises(ConnectionError, match="did not come back"):
                client.status()
        finally:
            client.close()


def test_malformed_bulk_stream_does_not_break_the_ps():
    with local_ps(1) as cluster:
        client = _client(cluster)
        try:
            _init(client)
            channel = grpc.insecure_channel(cluster.addrs[0])
            raw = channel.stream_unary("/elasticdl.PServer/push_gradient_chunks")
            with pytest.raises(grpc.RpcError) as err:
                raw(iter([b"\x22\x10abc"]), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed" in err.value.details()
            channel.close()
            assert cluster.shards[0].version == 0
            assert _push(client, {"w": torch.ones(2, 3)}) == (True, 1)
        finally:
            client.close()
