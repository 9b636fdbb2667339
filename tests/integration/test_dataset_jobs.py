"""A model module's ``dataset(path, mode)`` in real jobs.

* ParameterServerStrategy (2 workers, 2 PS) and AllreduceStrategy (2 workers), each worker
  loading through a DataLoader with a worker process (``--data_loader_workers=1``): the
  master sizes the dataset in its probe subprocess, and the record-counting model
  (``tests/fixtures/zoo/toy/count_dataset.py``) shows every record trained exactly once per
  epoch; the dataset's own log shows every index loaded by DataLoader worker processes.
* Local: the pytorch/examples ``Net`` through ``mnist.mnist_dataset`` (no ``feed``) reaches
  the validation accuracy of a plain PyTorch loop over the same data within 0.01.
* PS and allreduce, 2 workers: ``Net``'s exported ``model.pt`` (loaded strict into ``Net``)
  within 0.02 of the plain loop's band over minibatch orders.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import numpy as np
import pytest
import torch

from tests.conftest import FIXTURE_ZOO, MODEL_ZOO
from tests.integration.helpers import kill_job_tree, read_json, start_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

RECORDS, EPOCHS = 96, 2

STRATEGIES = {
    "PS": ["--distribution_strategy=ParameterServerStrategy", "--num_workers=2",
           "--num_ps_pods=2"],
    "Allreduce": ["--distribution_strategy=AllreduceStrategy", "--num_workers=2"],
}


def _run(args: list[str], job_dir: str, tmp_path, **env: str) -> dict:
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / "cli.log"), **env)
    try:
        assert proc.wait(timeout=800) == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report is not None and report["status"] == "succeeded", report
    return report


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_module_dataset_trains_every_record_once_per_epoch(strategy, tmp_path):
    data = tmp_path / "ids.npy"
    np.save(data, np.arange(RECORDS, dtype=np.int64))
    job_dir, log = str(tmp_path / "job"), tmp_path / "loaded.log"
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.count_dataset.custom_model",
            f"--training_data={data}", f"--output={job_dir}", "--cluster=local",
            f"--job_name=ds-{strategy.lower()}", f"--num_epochs={EPOCHS}", "--minibatch_size=8",
            "--num_minibatches_per_task=2", "--data_loader_workers=1", *STRATEGIES[strategy]]
    report = _run(args, job_dir, tmp_path, COUNT_RECORDS=str(RECORDS),
                  COUNT_DATASET_LOG=str(log))
    assert report["dataset"]["training_records"] == RECORDS
    assert [e["records_completed"] for e in report["epochs"]] == [RECORDS] * EPOCHS
    state = torch.load(os.path.join(job_dir, "model.pt"), weights_only=True)
    for name in ("even", "odd"):   # optimizer steps that trained each record
        assert state[name].tolist() == [EPOCHS] * RECORDS, (name, state[name].tolist())
    loaded = [line.split() for line in log.read_text().split("\n") if line]
    # the probe's len() loads nothing; every training load came from a worker's loader
    assert sorted(int(i) for _, i in loaded) == sorted(list(range(RECORDS)) * EPOCHS)
    assert len({p for p, _ in loaded}) >= 2   # each worker's DataLoader process


@pytest.fixture(scope="module")
def digits_subset(digits_data, tmp_path_factory) -> str:
    """The first 384 training images (the validation set is the full 360)."""
    out = tmp_path_factory.mktemp("digits-384")
    with np.load(os.path.join(digits_data, "train", "part-0000.npz")) as z:
        np.savez(out / "part-0000.npz", image=z["image"][:384], label=z["label"][:384])
    return str(out)


def _plain_net_accuracy(train: str, val: str, epochs: int, batch: int,
                        order: Optional[int] = None) -> float:
    """The plain loop's validation accuracy; ``order``: shuffled minibatches (that
    seed's order each epoch) and that seed's dropout masks, else data order."""
    if MODEL_ZOO not in sys.path:
        sys.path.insert(0, MODEL_ZOO)
    from mnist import mnist_dataset as m

    torch.manual_seed(0)
    model = m.custom_model()
    opt = m.optimizer(model.parameters())
    sched = m.lr_scheduler(opt)
    if order is not None:
        torch.manual_seed(100 + order)
    model.train()
    for epoch in range(epochs):
        # a DataLoader's own generator, as the framework's: iterating it draws nothing from
        # the global RNG, so dropout gets the same masks as in the job
        generator = torch.Generator()
        if order is not None:
            generator.manual_seed(10 * order + epoch)
        loader = torch.utils.data.DataLoader(m.dataset(train, "training"), batch_size=batch,
                                             shuffle=order is not None, generator=generator)
        for x, y in loader:
            opt.zero_grad()
            m.loss(y, model(x)).backward()
            opt.step()
        sched.step()
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(m.dataset(val, "evaluation"), batch_size=256):
            correct += int((model(x).argmax(1) == y).sum())
    return correct / 360


def test_net_through_a_torch_dataset_matches_the_plain_loop(digits_subset, digits_data,
                                                           tmp_path):
    val = os.path.join(digits_data, "val")
    job_dir = str(tmp_path / "job")
    args = ["train", f"--model_zoo={MODEL_ZOO}", "--model_def=mnist.mnist_dataset.custom_model",
            f"--training_data={digits_subset}", f"--validation_data={val}",
            f"--output={job_dir}", "--cluster=local", "--job_name=net-dataset",
            "--num_epochs=2", "--minibatch_size=32", "--distribution_strategy=Local"]
    report = _run(args, job_dir, tmp_path)
    accuracy = report["final_metrics"]["accuracy"]
    plain = _plain_net_accuracy(digits_subset, val, 2, 32)
    print(f"Net via a torch Dataset, Local: accuracy {accuracy:.4f}, plain loop {plain:.4f}")
    assert abs(accuracy - plain) <= 0.01, (accuracy, plain)
    assert accuracy > 0.5, accuracy   # it learned


NET_EPOCHS, NET_BATCH, NET_ORDERS = 3, 32, 6
# the job's own spread is wider than 6 plain orders show: it pairs two workers'
# minibatches as they come and, at each epoch's end where one worker has no task left,
# applies single-push groups (the sync wait expires); 10 PS jobs on this machine gave
# 0.9417..0.9667 (0.9417 twice) against a plain band of 0.9583..0.9667, i.e. 6 of 360
# images below it; 0.02 is 7 images, and a job that trains wrongly lands far outside
NET_MARGIN = 0.02


@pytest.fixture(scope="module")
def net_band(digits_data) -> tuple[float, float]:
    """The (lowest, highest) accuracy of the plain loop over the full digits training set
    in ``NET_ORDERS`` minibatch orders and dropout seeds. Two workers train in an order no
    seed fixes (they interleave; each draws its own dropout masks), and on 360 validation
    images the order alone moves the plain loop's accuracy by about 0.02 (measured: 8 orders
    of 4 epochs gave 0.919..0.942), so a two-worker job is held to the band, ``NET_MARGIN``
    either side."""
    train, val = (os.path.join(digits_data, s) for s in ("train", "val"))
    # one thread: on a quiet machine one order takes 5.7 s with one thread as with two,
    # and beside the suite's other tests a second thread only spins (this fixture took
    # 92-206 s of a loaded CI run)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        accs = [_plain_net_accuracy(train, val, NET_EPOCHS, NET_BATCH, order)
                for order in range(NET_ORDERS)]
    finally:
        torch.set_num_threads(threads)
    return min(accs), max(accs)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_net_in_two_workers_within_the_plain_loops_band(strategy, digits_data, net_band,
                                                       tmp_path):
    """The pytorch/examples ``Net`` (as published, through its torch Dataset) in PS
    (2 workers x 2 PS, sync: one update per global minibatch of 32) and allreduce (2 x 16):
    validation accuracy of the exported ``model.pt``, loaded strict into ``Net``, within
    ``NET_MARGIN`` of the plain loop's band over minibatch orders."""
    if MODEL_ZOO not in sys.path:
        sys.path.insert(0, MODEL_ZOO)
    from mnist import mnist_dataset as m

    val = os.path.join(digits_data, "val")
    job_dir = str(tmp_path / "job")
    sync = ["--grads_to_wait=2"] if strategy == "PS" else []
    args = ["train", f"--model_zoo={MODEL_ZOO}", "--model_def=mnist.mnist_dataset.custom_model",
            f"--training_data={os.path.join(digits_data, 'train')}", f"--validation_data={val}",
            f"--output={job_dir}", "--cluster=local", f"--job_name=net-{strategy.lower()}",
            f"--num_epochs={NET_EPOCHS}", f"--minibatch_size={NET_BATCH // 2}",
            "--num_minibatches_per_task=4", *STRATEGIES[strategy], *sync]
    report = _run(args, job_dir, tmp_path, OMP_NUM_THREADS="1")
    model = m.Net()
    model.load_state_dict(torch.load(os.path.join(job_dir, "model.pt"), weights_only=True))
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(m.dataset(val, "evaluation"), batch_size=256):
            correct += int((model(x).argmax(1) == y).sum())
    accuracy = correct / 360
    low, high = net_band
    print(f"Net {strategy}: model.pt accuracy {accuracy:.4f} (job's final "
          f"{report['final_metrics']['accuracy']:.4f}), plain loop {low:.4f}..{high:.4f} over "
          f"{NET_ORDERS} orders")
    assert abs(accuracy - report["final_metrics"]["accuracy"]) < 1e-9, report["final_metrics"]
    assert low - NET_MARGIN <= accuracy <= high + NET_MARGIN, (accuracy, (low, high),
                                                               report["evaluations"])
