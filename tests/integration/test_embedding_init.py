"""Embedding on the standard nn.Embedding idiom, end to end with real PS processes:

* the same seed gives bitwise the same initial rows in Local and on the PS (torchfm's
  ``xavier_uniform_(weight.data)``, DeepCTR-Torch's ``normal_(weight, std=1e-4)``, a padding
  row that stays zero), the rows travelling in many push_model parts;
* torchfm's DeepFM (model_zoo/deepfm/deepfm_torchfm.py) trains under Local and under PS
  (2 workers, 2 PS), and its exported model equals what the PS hold;
* an unsupported option makes the CLI exit non-zero within seconds, before any replica.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from elasticdl.api.model_spec import load_model_spec
from elasticdl.checkpoint import ps_shards
from elasticdl.common.job_spec import JobSpec
from elasticdl.worker.ps_client import PSClient
from elasticdl.worker.ps_trainer import PSTrainer
from elasticdl.worker.trainer import LocalTrainer
from tests.conftest import MODEL_ZOO
from tests.integration.helpers import start_cli
from tests.integration.ps_procs import PSProcess, run_in_threads

pytestmark = pytest.mark.integration

IDIOM_MODULE = '''
import torch
from torch import nn

from elasticdl.api.layers import Embedding


class Model(nn.Module):
    def __init__(self, init):
        super().__init__()
        self.emb = Embedding(30011, 8)
        if init == "torchfm":
            torch.nn.init.xavier_uniform_(self.emb.weight.data)
        else:  # DeepCTR-Torch
            nn.init.normal_(self.emb.weight, mean=0, std=1e-4)
        self.pad = Embedding(101, 4, padding_idx=7)   # nn.Embedding's own init
        self.lazy = Embedding(1000, 2, initializer="normal:0.1")
        self.fc = nn.Linear(14, 1)

    def forward(self, ids):
        x = torch.cat([self.emb(ids[:, 0]), self.pad(ids[:, 1] % 101),
                       self.lazy(ids[:, 2] % 1000)], dim=1)
        return self.fc(x).squeeze(-1)


def custom_model(init="torchfm"):
    return Model(init)


def loss(labels, outputs):
    return nn.functional.binary_cross_entropy_with_logits(outputs, labels)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def feed(records, mode):
    return records, None
'''


def _zoo(tmp_path, package: str, source: str) -> str:
    zoo = tmp_path / "zoo"
    (zoo / package).mkdir(parents=True)
    (zoo / package / "__init__.py").write_text("")
    (zoo / package / "model.py").write_text(textwrap.dedent(source))
    return str(zoo)


def _ps_job(zoo: str, model_def: str, **kw) -> JobSpec:
    return JobSpec(model_zoo=zoo, model_def=model_def, training_data="unused",
                   distribution_strategy="ParameterServerStrategy", seed=7, **kw)


@pytest.mark.parametrize("init", ["torchfm", "deepctr"])
def test_same_seed_gives_the_same_initial_rows_in_local_and_on_the_ps(tmp_path, init):
    package = f"idiom_{init}"
    zoo = _zoo(tmp_path, package, IDIOM_MODULE)
    model_def = f"{package}.model.custom_model"
    spec = load_model_spec(zoo, model_def, model_kwargs={"init": init})
    job = _ps_job(zoo, model_def, num_ps_pods=2, num_workers=2)
    local = LocalTrainer(spec, torch.device("cpu"), seed=job.seed).model.state_dict()
    procs: list[PSProcess] = []
    trainers: list[PSTrainer] = []
    try:
        procs = [PSProcess(i, 2, job, log_path=str(tmp_path / f"ps-{i}.log")) for i in range(2)]
        addrs = [p.addr for p in procs]
        # 64 KiB parts: the 0.96 MB table reaches each PS in 8 push_model messages
        trainers = [PSTrainer(spec, addrs, job, w, torch.device("cpu"), init_timeout_s=60,
                              client=PSClient(addrs, rpc_timeout_s=60, chunk_bytes=64 << 10))
                    for w in range(2)]
        trainer = trainers[1]  # not the worker that pushed: it reads what the PS hold
        assert "emb.weight" not in trainer.model.state_dict()   # the local table was dropped
        for name, rows in local.items():
            if name in trainer.tables:
                spec_ = trainer.tables[name]
                got = trainer.client.pull_embedding_unique(
                    name, np.arange(spec_.num_embeddings), spec_.dim, spec_.dtype, create=False)
            else:
                trainer.pull_dense()
                got = trainer.model.state_dict()[name]
            assert got.dtype == rows.dtype and torch.equal(got, rows), name  # bitwise
        assert torch.equal(local["pad.weight"][7], torch.zeros(4))
        if init == "torchfm":
            assert float(local["emb.weight"].abs().max()) <= (6 / (30011 + 8)) ** 0.5
        else:
            assert 0.8e-4 < float(local["emb.weight"].std()) < 1.2e-4
    finally:
        for tr in trainers:
            tr.close()
        for p in procs:
            p.kill()


FIELDS = 4      # the last 4 fields of gen_data: 26,100 ids (Local Adam updates them densely)
BATCH = 256


def _deepfm_batches(n: int, seed: int):
    if MODEL_ZOO not in sys.path:
        sys.path.insert(0, MODEL_ZOO)
    from deepfm import gen_data

    data = gen_data.generate(n, seed=seed)
    ids = torch.from_numpy(data["ids"][:, -FIELDS:].copy())
    return ids, torch.from_numpy(data["label"]), list(gen_data.FIELD_SIZES[-FIELDS:])


def test_torchfm_deepfm_trains_local_and_ps_and_exports_what_the_ps_hold(tmp_path):
    ids, labels, field_dims = _deepfm_batches(24_000, seed=0)
    n_val = 4000
    model_def = "deepfm.deepfm_torchfm.custom_model"
    spec = load_model_spec(MODEL_ZOO, model_def,
                           model_kwargs={"field_dims": field_dims, "lr": 0.01})
    mod = spec.module
    steps = range(n_val, len(labels) - BATCH + 1, BATCH)

    def val_auc(model_fn) -> float:
        with torch.no_grad():
            return float(mod.auc(labels[:n_val], model_fn(ids[:n_val])))

    # Local: the plain training loop
    local = LocalTrainer(spec, torch.device("cpu"), seed=3)
    losses = [float(local.train_minibatch(ids[s:s + BATCH], labels[s:s + BATCH]))
              for s in steps]
    local.model.eval()
    local_auc = val_auc(local.model)
    assert local_auc > 0.62 and np.mean(losses[-5:]) < np.mean(losses[:5]), (local_auc, losses)

    # PS: 2 workers, 2 PS, sync
    ckpt = str(tmp_path / "ckpt")
    job = _ps_job(MODEL_ZOO, model_def, num_ps_pods=2, num_workers=2, grads_to_wait=2,
                  checkpoint_dir=ckpt, model_params="lr=0.01")  # what the PS needs
    procs: list[PSProcess] = []
    trainers: list[PSTrainer] = []
    try:
        procs = [PSProcess(i, 2, job, log_path=str(tmp_path / f"ps-{i}.log"),
                           extra=["--sync_wait_min_s=30"]) for i in range(2)]
        addrs = [p.addr for p in procs]
        trainers = [PSTrainer(spec, addrs, job, w, torch.device("cpu"), init_timeout_s=60)
                    for w in range(2)]

        def run(w: int) -> None:
            for _ in range(2):  # 2 epochs: row-wise ("lazy") Adam on the PS moves rows
                #                 only when they are seen, dense Adam locally every step
                for s in list(steps)[w::2][:len(steps) // 2]:
                    trainers[w].train_minibatch(ids[s:s + BATCH], labels[s:s + BATCH])

        trainer = trainers[0]
        trainer.model.eval()
        auc_before = val_auc(trainer.forward)
        trainer.model.train()
        run_in_threads([lambda w=w: run(w) for w in range(2)], 300)
        trainer.model.eval()
        ps_auc = val_auc(trainer.forward)
        # upstream's N(0, 1) first-order rows move slowly under row-wise Adam at lr 1e-3
        # (the PS's optimizer does not take --model_params yet): assert it learns
        assert ps_auc > auc_before + 0.05, (auc_before, ps_auc)
        # the export path: a PS checkpoint, the worker's export and the rows the PS serve
        held = trainer.state_dict_from_ps()
        vdir = os.path.dirname(trainer.save_checkpoint())
        from_ckpt = ps_shards.export_state_dict(vdir)
        out = tmp_path / "export"
        trainer.export_model(str(out))
        exported = torch.load(out / "model.pt", weights_only=True)
        for name in ("embedding.embedding.weight", "linear.fc.weight"):
            assert held[name].shape == (sum(field_dims), 16 if "embedding" in name else 1)
        for name, value in held.items():
            assert torch.equal(exported[name], value), name
            if name in from_ckpt:
                assert torch.equal(from_ckpt[name], value), name
        assert set(from_ckpt) >= set(trainer.tables)
        # the export is a plain state dict of the same (nn.Embedding idiom) model
        torch.manual_seed(0)
        plain = spec.build_model()
        plain.load_state_dict(exported, strict=True)
        plain.eval()
        with torch.no_grad():
            assert torch.allclose(plain(ids[:n_val]), trainer.forward(ids[:n_val]), atol=1e-6)
    finally:
        for tr in trainers:
            tr.close()
        for p in procs:
            p.kill()


BAD_MODULE = '''
import torch
from torch import nn

from elasticdl.api.layers import Embedding


def custom_model():
    return nn.Sequential(Embedding(100, 4, {option}), nn.Flatten(), nn.Linear(8, 1))


def loss(labels, outputs):
    return nn.functional.mse_loss(outputs.squeeze(-1), labels)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def feed(records, mode):
    return torch.tensor([r["ids"] for r in records]), torch.tensor([r["y"] for r in records])
'''


@pytest.mark.parametrize("option,strategy,message", [
    ("max_norm=1.0", "ParameterServerStrategy", "max_norm"),
])
def test_unsupported_option_fails_in_the_client_before_any_replica(tmp_path, option, strategy,
                                                                    message):
    package = f"bad_{option.split('=')[0]}"
    zoo = _zoo(tmp_path, package, BAD_MODULE.replace("{option}", option))
    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "part-0.npz", ids=np.zeros((64, 2), dtype=np.int64),
             y=np.zeros(64, dtype=np.float32))
    out = tmp_path / "job"
    args = ["train", f"--model_zoo={zoo}", f"--model_def={package}.model.custom_model",
            f"--training_data={data}", f"--distribution_strategy={strategy}",
            "--cluster=local", "--num_workers=2", f"--output={out}",
            f"--job_name={package.replace('_', '-')}"]
    if strategy == "ParameterServerStrategy":
        args += ["--num_ps_pods=2", "--grads_to_wait=2"]
    log = tmp_path / "cli.log"
    start = time.monotonic()
    proc = start_cli(args, str(tmp_path / "home"), str(log))
    try:
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    elapsed = time.monotonic() - start
    text = log.read_text()
    assert code == 2, text
    assert message in text and "model.py" in text, text
    assert elapsed < 20, elapsed  # seconds (torch import and one model build), not tens
    # no master, PS or worker was ever launched
    launched = [p for p in ("master.json", "replicas.json", "logs/master.log")
                if (out / p).exists()]
    logs = list((out / "logs").glob("*.log")) if (out / "logs").exists() else []
    assert not launched and not logs, (launched, logs)
