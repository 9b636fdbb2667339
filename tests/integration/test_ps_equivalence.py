"""Sync PS training equals single-process training on the union batches;
a PS killed with SIGKILL comes back from its checkpoint and training goes on.

Real PS processes (``python -m elasticdl.ps.main``) on 127.0.0.1; the two
workers are PSTrainers in threads of this process.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from elasticdl.api.model_spec import load_model_spec
from elasticdl.checkpoint import single as ckpt
from elasticdl.common.job_spec import JobSpec
from elasticdl.worker.ps_client import PSClient
from elasticdl.worker.ps_trainer import PSTrainer
from elasticdl.worker.trainer import LocalTrainer
from tests.conftest import FIXTURE_ZOO
from tests.integration.helpers import wait_for
from tests.integration.ps_procs import PSProcess, run_in_threads

pytestmark = pytest.mark.integration

MODEL_DEF = "toy.ctr.custom_model"
STEPS = 6
BATCH = 16


def _job(**kw) -> JobSpec:
    return JobSpec(model_zoo=FIXTURE_ZOO, model_def=MODEL_DEF, training_data="unused",
                   distribution_strategy="ParameterServerStrategy", seed=3, **kw)


def _trainer(job: JobSpec, addrs: list[str], worker_id: int) -> PSTrainer:
    client = PSClient(addrs, rpc_timeout_s=30, reconnect_timeout_s=30)
    return PSTrainer(load_model_spec(FIXTURE_ZOO, MODEL_DEF), addrs, job, worker_id,
                     torch.device("cpu"), client=client, init_timeout_s=30)


def _table(trainer: PSTrainer) -> torch.Tensor:
    return trainer.client.pull_embedding("emb.weight", np.arange(100), 4)


def test_sync_two_workers_equal_single_process_on_union_batches(tmp_path):
    job = _job(num_ps_pods=2, num_workers=2, grads_to_wait=2)
    spec = load_model_spec(FIXTURE_ZOO, MODEL_DEF)
    batches = [spec.module.make_batches(STEPS, BATCH, seed=w) for w in range(2)]
    procs: list[PSProcess] = []
    trainers: list[PSTrainer] = []
    try:
        for i in range(2):
            # a fixed, generous sync wait: lockstep even if this machine stalls a while
            procs.append(PSProcess(i, 2, job, log_path=str(tmp_path / f"ps-{i}.log"),
                                   extra=["--sync_wait_min_s=30"]))
        addrs = [p.addr for p in procs]
        trainers = [_trainer(job, addrs, w) for w in range(2)]  # worker 0 initialises
        def run(w: int) -> None:
            for features, labels in batches[w]:
                trainers[w].train_minibatch(features, labels)

        run_in_threads([lambda w=w: run(w) for w in range(2)], 60)
        assert trainers[0].model_version == STEPS
        trainers[0].pull_dense()
        ps_params = {n: p.detach().clone() for n, p in trainers[0].model.named_parameters()}
        ps_params["emb.weight"] = _table(trainers[0])
    finally:
        for tr in trainers:
            tr.close()
        for p in procs:
            p.kill()

    local = LocalTrainer(spec, torch.device("cpu"), seed=job.seed)
    for k in range(STEPS):
        (ids_a, x_a), y_a = batches[0][k]
        (ids_b, x_b), y_b = batches[1][k]
        local.train_minibatch((torch.cat([ids_a, ids_b]), torch.cat([x_a, x_b])),
                              torch.cat([y_a, y_b]))
    expected = dict(local.model.named_parameters())
    assert set(expected) == set(ps_params)
    for name, value in expected.items():
        assert torch.allclose(ps_params[name], value.detach(), atol=1e-5, rtol=0), name
    # training did move the parameters
    init = LocalTrainer(spec, torch.device("cpu"), seed=job.seed).model.state_dict()
    assert not torch.allclose(init["fc.weight"], expected["fc.weight"])


def test_killed_ps_restarts_from_checkpoint_and_worker_reconnects(tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    job = _job(num_ps_pods=1, checkpoint_dir=ckpt_dir, checkpoint_steps=2,
               keep_checkpoint_max=2)
    spec = load_model_spec(FIXTURE_ZOO, MODEL_DEF)
    batches = spec.module.make_batches(8, BATCH, seed=0)
    log = str(tmp_path / "ps.log")
    ps = PSProcess(0, 1, job, log_path=log)
    trainer = None
    try:
        trainer = _trainer(job, [ps.addr], 0)
        for features, labels in batches[:5]:
            trainer.train_minibatch(features, labels)
        assert trainer.model_version == 5
        # checkpoints are written in the background (the PS trains on meanwhile): the
        # kill comes once version 4's is complete (a loaded machine took longer than the
        # 5th step to write it once in a CI run)
        wait_for(lambda: ckpt.complete_versions(ckpt_dir) == [2, 4], 60,
                 "checkpoints 2 and 4 to be complete")
        port = ps.port
        ps.kill()  # SIGKILL
        restarter = threading.Timer(1.0, lambda: restarted.append(
            PSProcess(0, 1, job, port=port, log_path=log)))
        restarted: list[PSProcess] = []
        restarter.start()
        try:
            # the step waits for the PS to come back, then continues from version 4
            trainer.train_minibatch(*batches[5])
        finally:
            restarter.join(60)
        assert trainer.model_version == 5
        for features, labels in batches[6:]:
            trainer.train_minibatch(features, labels)
        assert trainer.model_version == 7
        # the newest 2 (--keep_checkpoint_max) and what they are folded onto: 4 is a
        # delta on the whole 2 (6, the first after the restore, is whole)
        wait_for(lambda: ckpt.complete_versions(ckpt_dir) == [2, 4, 6], 60,
                 "checkpoint 6 to be complete")
        assert os.path.exists(os.path.join(ckpt.version_dir(ckpt_dir, 4), "ps-0-of-1.delta.json"))
        assert not os.path.exists(os.path.join(ckpt.version_dir(ckpt_dir, 6),
                                               "ps-0-of-1.delta.json"))
        ps = restarted[0]
        assert ps.terminate() == 0  # SIGTERM stops it cleanly
    finally:
        if trainer is not None:
            trainer.close()
        ps.kill()
        for p in locals().get("restarted", []):
            p.kill()
