"""Local-strategy step time vs a plain PyTorch loop, side by side in one process.

Same model (the classic MNIST CNN from model_zoo/mnist), batch size, optimizer
and in-memory data (the digits set, upsampled to 28x28). The framework run
goes through everything a Local job does per step: task manager, reader,
feed, trainer, progress and callbacks. Rounds alternate between the two; each
round's ratio compares two runs taken back to back, and the median of those
ratios is the figure (robust to another process taking the CPU mid-run).
Run: python benchmarks/local_overhead.py [--rounds 5] [--steps 60] [--device cpu|cuda]
(--device: both loops train there, default cpu; on cuda the plain loop moves each
batch from host memory, as the framework does, and both sync on the loss every step)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = os.path.join(ROOT, "model_zoo")
sys.path.insert(0, ZOO)


def make_data(directory: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.random((n, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int64)
    os.makedirs(directory, exist_ok=True)
    np.savez(os.path.join(directory, "part-0.npz"), image=x, label=y)
    return x, y


def plain_loop(x: np.ndarray, y: np.ndarray, batch: int, steps: int,
               device: str = "cpu") -> float:
    from digits import digits_cnn as m

    torch.manual_seed(0)
    dev = torch.device(device)
    model = m.custom_model().to(dev)
    opt = m.optimizer(model.parameters())
    xt, yt = torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y)
    times = []
    last = time.perf_counter()
    for i in range(steps + 1):
        s = (i * batch) % (len(x) - batch)
        opt.zero_grad(set_to_none=True)
        xb = xt[s:s + batch].to(dev, non_blocking=True)
        yb = yt[s:s + batch].to(dev, non_blocking=True)
        loss = m.loss(yb, model(xb))
        loss.backward()
        opt.step()
        float(loss)  # the framework reads the loss for its progress line too
        now = time.perf_counter()
        if i:
            times.append(now - last)
        last = now
    return statistics.median(times)


def framework_loop(data_dir: str, out_dir: str, batch: int, steps: int,
                   device: str = "cpu") -> float:
    from elasticdl.common.job_spec import job_spec_from_flags
    from elasticdl.local.job import LocalJob

    spec = job_spec_from_flags("train", {
        "model_zoo": ZOO, "model_def": "digits.digits_cnn.custom_model",
        "training_data": data_dir, "minibatch_size": batch, "num_minibatches_per_task": 8,
        "output": out_dir, "job_name": "bench", "log_level": "WARNING", "device": device})
    job = LocalJob(spec)
    times: list[float] = []
    last = [0.0]

    def timer(task, done, loss):
        now = time.perf_counter()
        if last[0]:
            times.append(now - last[0])
        last[0] = now

    original = job._after_train_step

    def hook(task, done, loss):
        original(task, done, loss)
        timer(task, done, loss)
        if len(times) >= steps:
            raise StopIteration

    job._after_train_step = hook  # type: ignore[method-assign]
    try:
        job.run()
    except StopIteration:
        pass
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="seconds: 1 round of 5 steps")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where both loops train (default cpu)")
    a = ap.parse_args()
    if a.smoke:
        a.rounds, a.steps = 1, 5
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    import logging

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        x, y = make_data(data, a.batch * (a.steps + 10))
        plain, fw = [], []
        for r in range(a.rounds):
            plain.append(plain_loop(x, y, a.batch, a.steps, a.device))
            fw.append(framework_loop(data, os.path.join(tmp, f"out{r}"), a.batch, a.steps,
                                     a.device))
            print(f"round {r}: plain {plain[-1] * 1e3:.2f} ms/step, "
                  f"elasticdl Local {fw[-1] * 1e3:.2f} ms/step", flush=True)
    p, f = statistics.median(plain), statistics.median(fw)
    ratio = statistics.median(b / a for a, b in zip(plain, fw))
    print(f"device {a.device}"
          + (f" ({torch.cuda.get_device_name()})" if a.device == "cuda" else ""))
    print(f"median: plain {p * 1e3:.2f} ms/step, elasticdl Local {f * 1e3:.2f} ms/step, "
          f"median of per-round ratios {ratio:.3f}x (target <= 1.05x)")


if __name__ == "__main__":
    main()
