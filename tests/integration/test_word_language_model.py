"""Truncated BPTT with a carried LSTM state (issue 23): the word_language_model recipe
(pytorch/examples' RNNModel, unchanged) as a Local CLI job with --sequential_tasks
reaches the validation perplexity of the plain truncated-BPTT loop on the same tokens
within 2%, and its model.pt loads into the upstream class."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import MODEL_ZOO
from tests.integration.helpers import kill_job_tree, read_json, start_cli

pytestmark = pytest.mark.integration

EPOCHS = 3
BPTT = 35


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory) -> str:
    sys.path.insert(0, MODEL_ZOO)
    from word_language_model import gen_data

    out = str(tmp_path_factory.mktemp("lm"))
    gen_data.write(out, 30000, 6000, 200, 20, 10, BPTT)
    return out


def plain_loop(data: str, seed: int = 0) -> float:
    """pytorch/examples main.py's train()/evaluate() on the same windows: the final
    validation perplexity."""
    sys.path.insert(0, MODEL_ZOO)
    from word_language_model import lm

    train = torch.from_numpy(np.load(os.path.join(data, "train", "part-0000.npy")))
    val = torch.from_numpy(np.load(os.path.join(data, "val", "part-0000.npy")))
    torch.manual_seed(seed)
    model = lm.custom_model()
    opt = lm.optimizer(model.parameters())
    sched = lm.lr_scheduler(opt)["scheduler"]

    def repackage(h):
        return tuple(v.detach() for v in h)

    def evaluate() -> float:
        model.eval()
        total, hidden = 0.0, model.init_hidden(val.shape[2])
        with torch.no_grad():
            for w in val:
                out, hidden = model(w[:-1], hidden)
                total += float(F.nll_loss(out, w[1:].reshape(-1)))
        model.train()
        return total / len(val)

    val_loss = float("nan")
    for _ in range(EPOCHS):
        hidden = model.init_hidden(train.shape[2])
        for w in train:
            hidden = repackage(hidden)
            opt.zero_grad()
            out, hidden = model(w[:-1], hidden)
            F.nll_loss(out, w[1:].reshape(-1)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            opt.step()
        val_loss = evaluate()
        sched.step(val_loss)
    return math.exp(val_loss)


def test_bptt_recipe_matches_the_plain_loop_local(lm_data, tmp_path):
    job_dir = str(tmp_path / "job")
    args = ["train", f"--model_zoo={MODEL_ZOO}", "--model_def=word_language_model.lm.custom_model",
            f"--training_data={lm_data}/train", f"--validation_data={lm_data}/val",
            f"--output={job_dir}", "--cluster=local", "--job_name=lm-local",
            "--distribution_strategy=Local", f"--num_epochs={EPOCHS}", "--minibatch_size=1",
            "--num_minibatches_per_task=10", "--sequential_tasks", "--clip_grad_norm=0.25"]
    # one intra-op thread: an LSTM step on a busy 2-core machine took 7 s with two
    # (oversubscribed) and 0.2 s with one
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / "cli.log"),
                     OMP_NUM_THREADS="1")
    try:
        assert proc.wait(timeout=280) == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    ours = math.exp(report["final_metrics"]["loss"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = plain_loop(lm_data)
    finally:
        torch.set_num_threads(threads)
    assert plain < 100, plain            # it learned the language (200 words)
    assert abs(ours - plain) / plain <= 0.02, (ours, plain)
    from word_language_model.model import RNNModel

    upstream = RNNModel("LSTM", 200, 64, 64, 2, 0.2)
    upstream.load_state_dict(torch.load(os.path.join(job_dir, "model.pt"), weights_only=True))
