"""A Hugging Face model (a 2-layer GPT-2 from a config, which TorchScript cannot
compile: OSError) trained by the `elasticdl` CLI with --export_torchscript: the job
succeeds, writes job_report.json and model.pt (loadable into GPT2LMHeadModel),
and warns about the TorchScript export, in Local and in AllreduceStrategy (where
a failing export used to kill the exporting worker and hang the master)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import FIXTURE_ZOO, ROOT
from tests.integration.helpers import cli_env, kill_job_tree, read_json, start_cli

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")


@pytest.fixture
def gpt2_data(tmp_path):
    sys.path.insert(0, FIXTURE_ZOO)
    from toy import tiny_gpt2

    tiny_gpt2.write_data(str(tmp_path / "train"), n=64)
    tiny_gpt2.write_data(str(tmp_path / "val"), n=32, seed=1)
    return tmp_path


def train_args(tmp, job, **flags):
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.tiny_gpt2.custom_model",
            f"--training_data={tmp / 'train'}", f"--validation_data={tmp / 'val'}",
            "--minibatch_size=16", "--num_minibatches_per_task=2", "--export_torchscript",
            f"--output={tmp / job}", f"--job_name={job}"]
    return args + [f"--{k}={v}" for k, v in flags.items()]


def check_exported(out_dir, log):
    report = read_json(os.path.join(out_dir, "job_report.json"))
    assert report is not None, log[-3000:]
    assert report["status"] == "succeeded", report.get("failure")
    assert report["epochs"][0]["records_completed"] == 64
    assert "GPT2LMHeadModel does not compile to TorchScript (OSError" in log
    assert not os.path.exists(os.path.join(out_dir, "model_scripted.pt"))
    from toy import tiny_gpt2

    model = tiny_gpt2.custom_model()  # the upstream class: GPT2LMHeadModel
    assert type(model) is transformers.GPT2LMHeadModel
    state = torch.load(os.path.join(out_dir, "model.pt"), weights_only=True)
    model.load_state_dict(state)  # strict: the model's own keys
    assert not torch.equal(state["transformer.wte.weight"],
                           tiny_gpt2.custom_model().state_dict()["transformer.wte.weight"])


def test_local_job_survives_a_failing_torchscript_export(gpt2_data):
    tmp = gpt2_data
    done = subprocess.run([sys.executable, "-m", "elasticdl_client.main",
                           *train_args(tmp, "local")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=cli_env(str(tmp / "home")))
    assert done.returncode == 0, done.stderr[-3000:]
    check_exported(str(tmp / "local"), done.stderr)


def test_allreduce_exporter_survives_a_failing_torchscript_export(gpt2_data):
    tmp = gpt2_data
    job_dir = str(tmp / "ar")
    proc = start_cli(train_args(tmp, "ar", distribution_strategy="AllreduceStrategy",
                                cluster="local", num_workers=1), str(tmp / "home"),
                     str(tmp / "cli.log"))
    try:
        code = proc.wait(timeout=400)
    finally:
        kill_job_tree(proc, job_dir)
    log = (tmp / "cli.log").read_text()
    assert code == 0, log[-3000:]
    worker_log = open(os.path.join(job_dir, "logs", "worker-0.log")).read()
    check_exported(job_dir, worker_log)
