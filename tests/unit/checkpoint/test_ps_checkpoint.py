"""PS checkpoints: save with 2 PS, restore with 1 and 3, export a plain state dict."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from elasticdl.api.layers import Embedding
from elasticdl.api.model_spec import load_model_spec
from elasticdl.checkpoint import api as ckpt_api
from elasticdl.checkpoint import ps_shards as ps_ckpt
from elasticdl.checkpoint import single as ckpt
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.tables import dense_owner
from elasticdl.ps import shard_checkpoint as shard_ckpt
from elasticdl.ps.shard import GradientPush, PSShard, ShardConfig
from elasticdl.worker.ps_client import PSClient
from elasticdl.worker.ps_trainer import PSTrainer
from tests.conftest import FIXTURE_ZOO
from tests.unit.ps_helpers import local_ps

MODEL_DEF = "toy.ctr_adam.custom_model"


def _spec():
    return load_model_spec(FIXTURE_ZOO, MODEL_DEF)


def _trainer(addrs) -> PSTrainer:
    job = JobSpec(model_zoo=FIXTURE_ZOO, model_def=MODEL_DEF, training_data="unused",
                  distribution_strategy="ParameterServerStrategy", num_ps_pods=len(addrs))
    client = PSClient(addrs, rpc_timeout_s=60, reconnect_timeout_s=2)  # loaded machines
    return PSTrainer(_spec(), addrs, job, 0, torch.device("cpu"), client=client)


def _restored(version_dir: str, num_ps: int) -> list[PSShard]:
    shards = []
    for i in range(num_ps):
        shard = PSShard(ShardConfig(ps_id=i, num_ps=num_ps), _spec().optimizer)
        assert shard_ckpt.restore_shard(shard, version_dir) == 3
        shards.append(shard)
    return shards


def _one_more_step(shards: list[PSShard], grads: dict, rows: tuple) -> None:
    """The same gradient applied to a sharded model, split by the new placement."""
    table, ids, grad = rows
    n = len(shards)
    for i, shard in enumerate(shards):
        mine = ids % n == i
        dense = {k: v.clone() for k, v in grads.items() if k in shard.params.dense}
        shard.push_gradients(GradientPush(version=shard.version, dense=dense, sparse=[
            (table, ids[mine], grad[torch.from_numpy(mine)].clone())]))


def _gather(shards: list[PSShard], table: str, ids: np.ndarray) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for s in shards:
        out.update({k: v.detach().clone() for k, v in s.params.dense.items()})
        out.update({k: v.clone() for k, v in s.params.buffers.items()})
    rows = torch.zeros(len(ids), 4)
    for i, s in enumerate(shards):
        mine = ids % len(shards) == i
        rows[torch.from_numpy(mine)] = s.pull_embedding(table, ids[mine])
    out[table] = rows
    return out


def test_save_with_two_restore_with_one_and_three_then_export(tmp_path):
    mod = _spec().module
    batches = mod.make_batches(3, 16, seed=1)
    ckpt_dir = str(tmp_path / "ckpt")
    with local_ps(2, _spec().optimizer, checkpoint_dir=ckpt_dir,
                  keep_checkpoint_max=2) as cluster:
        trainer = _trainer(cluster.addrs)
        try:
            for features, labels in batches:
                trainer.train_minibatch(features, labels)
            assert trainer.model_version == 3
            vdir = trainer.save_checkpoint()
            sizes = [s.params.tables["emb.weight"].size for s in cluster.shards]
            expected_outputs = trainer.forward(batches[0][0])
            [exported] = [p for p in trainer.export_model(str(tmp_path / "final"))
                          if p.endswith("model.pt")]
            # evaluation and export pull rows without creating them on the PS
            assert [s.params.tables["emb.weight"].size for s in cluster.shards] == sizes
            # the export wrote through the worker's own model, whose table stays on the
            # PS: no local weight after, and its lookups still pull the PS's rows
            tables = [m for m in trainer.model.modules() if isinstance(m, Embedding)]
            assert tables and all(m._parameters.get("weight") is None for m in tables)
            assert torch.equal(trainer.forward(batches[0][0]), expected_outputs)
        finally:
            trainer.close()
        assert sorted(os.listdir(vdir)) == ["DONE", "ps-0-of-2.pt", "ps-1-of-2.pt"]
        assert ckpt.complete_versions(ckpt_dir) == [3]

        # a further identical step on the original and on re-partitioned restores
        ids = np.arange(0, 100, 7, dtype=np.int64)
        gen = torch.Generator().manual_seed(5)
        grads = {n: torch.randn(p.shape, generator=gen)
                 for s in cluster.shards for n, p in s.params.dense.items()}
        rows = ("emb.weight", ids, torch.randn(len(ids), 4, generator=gen))
        restored = {n: _restored(vdir, n) for n in (1, 3)}
        _one_more_step(cluster.shards, grads, rows)
        reference = _gather(cluster.shards, "emb.weight", ids)
    for n, shards in restored.items():
        _one_more_step(shards, grads, rows)
        # rows the original created survive (with their per-row Adam state)
        assert sum(s.params.tables["emb.weight"].size for s in shards) == \
            sum(s.params.tables["emb.weight"].size for s in cluster.shards)
        got = _gather(shards, "emb.weight", ids)
        assert got.keys() == reference.keys()
        for k in reference:
            assert torch.allclose(got[k], reference[k], atol=1e-6), (n, k)

    # export: a plain state dict the model loads without elasticdl
    state = ps_ckpt.export_state_dict(vdir)
    assert state["emb.weight"].shape == (100, 4)
    model = mod.custom_model()
    model.load_state_dict(state, strict=True)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(batches[0][0]), expected_outputs, atol=1e-6)
    path = ps_ckpt.export_model(vdir, str(tmp_path / "out"))
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["emb.weight"], state["emb.weight"])
    # the worker's export (pulled from the live PS) holds the same model
    from_worker = torch.load(exported, weights_only=True)
    assert from_worker.keys() == state.keys()
    for k in state:
        assert torch.allclose(from_worker[k].float(), state[k].float(), atol=1e-6), k


def test_done_marker_only_when_all_shards_written_and_retention(tmp_path):
    spec = _spec()
    shards = [PSShard(ShardConfig(ps_id=i, num_ps=2), spec.optimizer) for i in range(2)]
    for i, s in enumerate(shards):
        s.initialize(0, {"p": torch.zeros(2)} if dense_owner("p", 2) == i else {}, {}, [])
    d = str(tmp_path)
    shard_ckpt.save_shard(shards[0], d, 1)
    assert ckpt.complete_versions(d) == []
    with pytest.raises(ckpt.CheckpointError, match="no complete"):
        ps_ckpt.load_shards(d)
    shard_ckpt.save_shard(shards[1], d, 1)
    assert ckpt.complete_versions(d) == [1]
    for v in (2, 3):
        for s in shards:
            shard_ckpt.save_shard(s, d, v, keep_max=2)
    # 2 and 3 are deltas of version 1 (whole): retention keeps what they are read from
    assert ckpt.complete_versions(d) == [1, 2, 3]
    assert ckpt_api.latest(d) == ckpt.version_dir(d, 3)
    for v in (4, 5):   # whole ones (the chain started over)
        for s in shards:
            s.chain.since_full = s.config.full_checkpoint_every
            shard_ckpt.save_shard(s, d, v, keep_max=2)
    assert ckpt.complete_versions(d) == [4, 5]


def test_restore_rejects_mixed_shard_counts(tmp_path):
    spec = _spec()
    vdir = ckpt.version_dir(str(tmp_path), 1)
    for n in (1, 2):
        s = PSShard(ShardConfig(ps_id=0, num_ps=n), spec.optimizer)
        s.initialize(1, {}, {}, [])
        ckpt.save_file(s.state_dict(), ps_ckpt.shard_path(vdir, 0, n))
    ckpt.mark_done(str(tmp_path), 1)
    with pytest.raises(ckpt.CheckpointError, match="one n"):
        ps_ckpt.load_shards(vdir)


def test_ps_restarted_without_checkpoint_gets_the_workers_model(tmp_path):
    from elasticdl.ps.server import start_server
    from elasticdl.ps.servicer import PServicer

    mod = _spec().module
    batches = mod.make_batches(4, 16, seed=2)
    with local_ps(1, _spec().optimizer) as cluster:
        trainer = _trainer(cluster.addrs)
        restarted = None
        try:
            for features, labels in batches[:2]:
                trainer.train_minibatch(features, labels)
            before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            cluster.stop(0)
            shard = PSShard(ShardConfig(), _spec().optimizer)
            restarted, _ = start_server(PServicer(shard), cluster.ports[0], "127.0.0.1")
            trainer.train_minibatch(*batches[2])  # re-initialises the PS, then steps
            # the PS restarted from the newest parameters the worker held: version 2,
            # which the answer to its second push brought (before push answers carried
            # the parameters the update of version 2 never reached a worker and was lost)
            assert shard.initialized and shard.version == 3
            params = shard.params.dense
            assert not torch.equal(params["fc.weight"], before["fc.weight"])
            assert params["fc.weight"].shape == before["fc.weight"].shape
            trainer.train_minibatch(*batches[3])
            assert trainer.model_version == 4
        finally:
            trainer.close()
            if restarted is not None:
                restarted.stop(0).wait(5)


def test_async_trainer_pulls_every_get_model_steps():
    mod = _spec().module
    job = JobSpec(model_zoo=FIXTURE_ZOO, model_def=MODEL_DEF, training_data="unused",
                  distribution_strategy="ParameterServerStrategy", use_async=True,
                  get_model_steps=3, lr_staleness_modulation=True)
    with local_ps(2, _spec().optimizer, use_async=True, lr_staleness_modulation=True) as cluster:
        client = PSClient(cluster.addrs, rpc_timeout_s=10, reconnect_timeout_s=2)
        trainer = PSTrainer(_spec(), cluster.addrs, job, 0, torch.device("cpu"), client=client)
        try:
            held = []
            for features, labels in mod.make_batches(5, 8, seed=3):
                trainer.train_minibatch(features, labels)
                held.append(list(trainer.versions))
            assert held == [[0, 0], [0, 0], [0, 0], [3, 3], [3, 3]]
            assert trainer.model_version == 5
        finally:
            trainer.close()


def test_final_checkpoint_of_parted_ps_versions_is_one_complete_version(tmp_path):
    """A sync job's PS versions part when a worker dies between its pushes to two PS
    (PS 0 applied a minibatch PS 1 never got). The final checkpoint used to be
    skipped (no one version named it); now the PS behind also writes the highest
    version's directory: one complete version, each shard's own state and its own
    trained records, restored at that version on every PS."""
    mod = _spec().module
    ckpt_dir = str(tmp_path / "ckpt")
    with local_ps(2, _spec().optimizer, checkpoint_dir=ckpt_dir, minibatch_size=16) as cluster:
        trainer = _trainer(cluster.addrs)
        try:
            for features, labels in mod.make_batches(3, 16, seed=1):
                trainer.train_minibatch(features, labels)
            lone = cluster.shards[0]     # the dead worker's push reached PS 0 only
            lone.push_gradients(GradientPush(
                version=lone.version, dense={k: torch.ones_like(v) for k, v in
                                             lone.params.dense.items()},
                task_id=99, minibatch=1, num_records=16))
            versions = [s.version for s in cluster.shards]
            assert versions == [4, 3]
            behind = {k: v.detach().clone() for k, v in cluster.shards[1].params.dense.items()}
            vdir = trainer.save_checkpoint()
        finally:
            trainer.close()
    assert os.path.basename(vdir) == "version-4" and ckpt.complete_versions(ckpt_dir) == [4]
    from elasticdl.checkpoint import data_position as dp

    found = dp.read_trained_set(vdir)
    held = {name: set(entries) for name, _, entries in found.writers}
    assert 99 in held["ps-0-of-2"] and 99 not in held["ps-1-of-2"], held
    for i in range(2):
        shard = PSShard(ShardConfig(ps_id=i, num_ps=2), _spec().optimizer)
        assert shard_ckpt.restore_shard(shard, vdir) == 4 and shard.version == 4
        if i == 1:
            for k, v in behind.items():
                assert torch.equal(shard.params.dense[k], v), k
