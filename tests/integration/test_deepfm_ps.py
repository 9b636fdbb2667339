"""DeepFM (2.05M embedding rows, created lazily) trained by two PS-mode
workers on two real PS processes: AUC on held-out click logs well above 0.5."""

from __future__ import annotations

import sys

import pytest
import torch

from elasticdl.api.model_spec import load_model_spec
from elasticdl.common.job_spec import JobSpec
from elasticdl.worker.ps_trainer import PSTrainer
from tests.conftest import MODEL_ZOO
from tests.integration.ps_procs import PSProcess, run_in_threads

pytestmark = pytest.mark.integration

MODEL_DEF = "deepfm.deepfm.custom_model"
BATCH = 512


def test_deepfm_learns_the_planted_signal_on_two_ps(tmp_path):
    spec = load_model_spec(MODEL_ZOO, MODEL_DEF)
    gen = sys.modules["deepfm.gen_data"]
    data = gen.generate(40_000, seed=0)
    n_val = 8_000
    job = JobSpec(model_zoo=MODEL_ZOO, model_def=MODEL_DEF, training_data="unused",
                  distribution_strategy="ParameterServerStrategy", num_ps_pods=2,
                  num_workers=2, grads_to_wait=2)
    procs: list[PSProcess] = []
    trainers: list[PSTrainer] = []
    try:
        procs = [PSProcess(i, 2, job, log_path=str(tmp_path / f"ps-{i}.log")) for i in range(2)]
        addrs = [p.addr for p in procs]
        trainers = [PSTrainer(spec, addrs, job, w, torch.device("cpu")) for w in range(2)]
        def batch(start: int):
            sl = slice(start, start + BATCH)
            return ((torch.from_numpy(data["ids"][sl]), torch.from_numpy(data["dense"][sl])),
                    torch.from_numpy(data["label"][sl]))

        def run(w: int) -> None:
            for start in range(n_val + w * BATCH, len(data["label"]) - BATCH, 2 * BATCH):
                trainers[w].train_minibatch(*batch(start))

        run_in_threads([lambda w=w: run(w) for w in range(2)], 120)
        features = (torch.from_numpy(data["ids"][:n_val]), torch.from_numpy(data["dense"][:n_val]))
        outputs = trainers[0].forward(features)
        labels = torch.from_numpy(data["label"][:n_val])
        metrics = {k: float(fn(labels, outputs)) for k, fn in spec.metrics().items()}
        assert metrics["auc"] > 0.7, metrics
        # both PS still serve, at the version the workers reached
        assert {s.version for s in trainers[0].client.status()} == {trainers[0].model_version}
    finally:
        for tr in trainers:
            tr.close()
        for p in procs:
            p.kill()
