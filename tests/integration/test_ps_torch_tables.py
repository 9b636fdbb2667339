"""torch's own nn.EmbeddingBag on the parameter servers in a real job (issue 28): the
counting fixture (tests/fixtures/zoo/toy/count_bags.py, plain torch model code) on 2
workers x 2 PS, one worker SIGKILLed after a pushed but unreported task; every record's
two rows in the exported model count exactly the epochs."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch

from elasticdl.worker.ps_trainer import KILL_AFTER_STEPS_ENV
from tests.conftest import FIXTURE_ZOO, ID_RECORDS
from tests.integration.helpers import kill_job_tree, read_json, start_cli

pytestmark = pytest.mark.integration

EPOCHS = 3
MINIBATCH = 8


def test_torch_embedding_bag_on_ps_applies_every_record_once(id_data, tmp_path):
    job_dir = str(tmp_path / "job")
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.count_bags.custom_model",
            f"--training_data={id_data}", f"--output={job_dir}", "--job_name=count-bags",
            "--cluster=local", f"--minibatch_size={MINIBATCH}", "--num_minibatches_per_task=4",
            f"--num_epochs={EPOCHS}", "--distribution_strategy=ParameterServerStrategy",
            "--num_workers=2", "--num_ps_pods=2", "--shuffle",
            f"--envs={KILL_AFTER_STEPS_ENV}=1:4"]   # worker 1 dies after its first task
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / "cli.log"),
                     COUNT_RECORDS=str(ID_RECORDS))
    try:
        assert proc.wait(timeout=420) == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    assert [e["records_applied"] for e in report["epochs"]] == [ID_RECORDS] * EPOCHS
    assert ("worker-1", "killed") in {(r["replica"], r["reason"]) for r in report["relaunches"]}
    state = torch.load(os.path.join(job_dir, "model.pt"), weights_only=True)
    assert set(state) == {"bags.weight", "bias"}   # torch's own key, a plain state dict
    rows = state["bags.weight"].flatten()
    assert rows.shape == (2 * ID_RECORDS,)
    wrong = (rows != EPOCHS).nonzero().flatten().tolist()
    assert not wrong, [(i, rows[i].item()) for i in wrong[:20]]
    for i in range(2):
        with open(os.path.join(job_dir, f"ps-{i}-ledger.json")) as f:
            ledger = json.load(f)
        identities = Counter((t, mb) for t, mb, _, _ in ledger["applied"])
        assert max(identities.values()) == 1
