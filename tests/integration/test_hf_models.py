"""Hugging Face models as published, in every strategy, against a plain PyTorch loop.

``model_zoo/gpt2/gpt2_tiny.py``: a ``transformers`` ``GPT2LMHeadModel`` built from a 2-layer
config (random init, no download), its data a ``torch.utils.data.Dataset`` of
``{"input_ids", "labels"}`` dicts read through a DataLoader; no ``feed`` and no adapter module,
so the framework calls ``model(**batch)`` and the loss is ``outputs.loss`` of the model's
``ModelOutput``. Each strategy runs as a real CLI job (Local; ParameterServerStrategy with 2
workers and 2 PS; AllreduceStrategy with 2 workers) and must reach the validation perplexity
of a plain loop over the same data with the same global batch (the distributed jobs
average two workers' minibatches of 16 per update, the plain loop and Local take 32). The
exported ``model.pt`` loads into ``GPT2LMHeadModel`` unchanged (strict) and gives the job's
final validation loss. Local reads the records in order and must match the in-order loop;
the two-worker jobs' minibatch order depends on which worker takes which task, and order
alone moves this short run's perplexity by several percent, so they must land inside the
plain loop's range over 8 minibatch orders (2% either side). ``gpt2_datasets`` reads the
same tokens from a ``datasets`` ``save_to_disk`` directory through the built-in Arrow
reader, with a ``feed`` returning a dict: it must match the Local job.
"""

from __future__ import annotations

import math
import os
import random
import sys

import pytest
import torch

from tests.conftest import MODEL_ZOO
from tests.integration.helpers import kill_job_tree, read_json, start_cli

# a whole job per test: transformers imports alone take minutes on a loaded 2-core machine
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

TRAIN, VAL, EPOCHS, GLOBAL_BATCH = 256, 64, 2, 32

STRATEGIES = {
    "Local": ["--distribution_strategy=Local", f"--minibatch_size={GLOBAL_BATCH}"],
    "PS": ["--distribution_strategy=ParameterServerStrategy", "--num_workers=2",
           "--num_ps_pods=2", "--grads_to_wait=2", f"--minibatch_size={GLOBAL_BATCH // 2}"],
    "Allreduce": ["--distribution_strategy=AllreduceStrategy", "--num_workers=2",
                  f"--minibatch_size={GLOBAL_BATCH // 2}"],
}


def _zoo():
    if MODEL_ZOO not in sys.path:
        sys.path.insert(0, MODEL_ZOO)
    from gpt2 import gen_data, gpt2_tiny

    return gen_data, gpt2_tiny


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> dict[str, str]:
    gen_data, _ = _zoo()
    out = str(tmp_path_factory.mktemp("gpt2"))
    dirs = gen_data.write(out, TRAIN, VAL)
    return {**dirs, **{f"{k}_hf": v for k, v in gen_data.write(out, TRAIN, VAL, "hf").items()}}


def _val_loss(model, val_dir: str) -> float:
    _, g = _zoo()
    ds = g.dataset(val_dir, "evaluation")
    model.eval()
    total = 0.0
    with torch.no_grad():
        for batch in torch.utils.data.DataLoader(ds, batch_size=GLOBAL_BATCH):
            total += float(model(**batch).loss) * len(batch["input_ids"])
    return total / len(ds)


def _plain_loop(train_dir: str, val_dir: str, order_seed: int | None) -> float:
    """The plain PyTorch loop: same init seed, batch, optimizer, epochs. ``order_seed``
    None reads the records in order (as Local does); otherwise each epoch's 16-record
    minibatches are shuffled and paired into steps of 32, an order a two-worker job with
    dynamic sharding can take (which two minibatches meet in a step depends on which worker
    took which task)."""
    _, g = _zoo()
    torch.manual_seed(0)
    model = g.custom_model()
    opt = g.optimizer(model.parameters())
    train = g.dataset(train_dir, "training")
    half = GLOBAL_BATCH // 2
    for epoch in range(EPOCHS):
        mbs = [list(range(i, min(i + half, len(train)))) for i in range(0, len(train), half)]
        if order_seed is not None:
            random.Random(order_seed * 1000 + epoch).shuffle(mbs)
        for k in range(0, len(mbs), 2):
            batch = torch.utils.data.default_collate(
                [train[i] for mb in mbs[k:k + 2] for i in mb])
            opt.zero_grad()
            model(**batch).loss.backward()
            opt.step()
    return _val_loss(model, val_dir)


@pytest.fixture(scope="module")
def plain_loss(tokens) -> float:
    """Validation loss of the plain loop reading the records in order."""
    return _plain_loop(tokens["train"], tokens["val"], None)


@pytest.fixture(scope="module")
def plain_band(tokens) -> tuple[float, float]:
    """The (lowest, highest) validation perplexity of the plain loop over 8 minibatch
    orders. Order alone moves this 16-step run's perplexity by -6%..+2% (measured), so a
    job whose order is not fixed is held to the band, not to one order; losing a quarter
    of the updates (6.1 against ~5.1) or training an extra epoch (~4.0) falls outside."""
    ppl = [math.exp(_plain_loop(tokens["train"], tokens["val"], s)) for s in range(8)]
    return min(ppl), max(ppl)


def _run(model_def: str, train: str, val: str, strategy: str, tmp_path) -> dict:
    job_dir = str(tmp_path / "job")
    args = ["train", f"--model_zoo={MODEL_ZOO}", f"--model_def={model_def}",
            f"--training_data={train}", f"--validation_data={val}", f"--output={job_dir}",
            "--cluster=local", f"--job_name=hf-{strategy.lower()}", f"--num_epochs={EPOCHS}",
            "--num_minibatches_per_task=2", "--data_loader_workers=1", *STRATEGIES[strategy]]
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        assert proc.wait(timeout=1100) == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report is not None and report["status"] == "succeeded", report
    assert [e["records_completed"] for e in report["epochs"]] == [TRAIN] * EPOCHS
    # the DataLoader processes (forked from a worker whose gRPC threads are busy) live
    # through the job: a death is retried, so only the log shows one (it used to be most)
    log = (tmp_path / "cli.log").read_text(errors="replace")
    assert "DataLoader worker process died" not in log, log[-3000:]
    report["job_dir"] = job_dir
    return report


def _check_export(report: dict, val_dir: str) -> None:
    """model.pt is GPT2LMHeadModel's own state dict and is the trained model."""
    from transformers import GPT2LMHeadModel

    _, g = _zoo()
    state = torch.load(os.path.join(report["job_dir"], "model.pt"), weights_only=True)
    model = GPT2LMHeadModel(g.config())
    assert set(state) == set(model.state_dict()), sorted(set(state) ^ set(model.state_dict()))
    model.load_state_dict(state)   # strict: no adapter prefix, nothing missing
    assert _val_loss(model, val_dir) == pytest.approx(report["final_metrics"]["loss"], rel=1e-4)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_gpt2_from_config_matches_the_plain_loop(strategy, tokens, plain_loss, plain_band,
                                                tmp_path):
    report = _run("gpt2.gpt2_tiny.custom_model", tokens["train"], tokens["val"], strategy,
                  tmp_path)
    ppl, plain = math.exp(report["final_metrics"]["loss"]), math.exp(plain_loss)
    low, high = plain_band
    print(f"GPT-2 {strategy}: perplexity {ppl:.4f}, plain loop {plain:.4f} in order, "
          f"{low:.4f}..{high:.4f} over 8 orders")
    if strategy == "Local":   # one process reading tasks in order: the in-order loop
        assert abs(ppl / plain - 1) < 0.02, (ppl, plain, report["evaluations"])
    else:                     # two workers: an order of the band, 2% either side
        assert low / 1.02 < ppl < high * 1.02, (ppl, (low, high), report["evaluations"])
    _check_export(report, tokens["val"])


def test_gpt2_on_a_datasets_directory(tokens, plain_loss, tmp_path):
    report = _run("gpt2.gpt2_datasets.custom_model", tokens["train_hf"], tokens["val_hf"],
                  "Local", tmp_path)
    ppl, plain = math.exp(report["final_metrics"]["loss"]), math.exp(plain_loss)
    print(f"GPT-2 on a datasets directory (Local): perplexity {ppl:.4f}, plain {plain:.4f}")
    assert abs(ppl / plain - 1) < 0.02, (ppl, plain)
    _check_export(report, tokens["val"])
