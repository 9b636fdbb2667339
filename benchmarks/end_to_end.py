"""Whole Local jobs against a plain PyTorch loop, end to end (issue 23).

Each case runs, as separate processes and alternating which goes first:

* candidate: ``elasticdl train --distribution_strategy=Local`` (the CLI as a user runs
  it: start-up, model check, data reading through tasks, evaluation at each epoch end,
  the final ``model.pt`` and job report);
* baseline: this script's ``--plain`` role, a plain PyTorch loop as a user writes it for
  the same model module: read the same npz files, the module's ``feed`` once over all
  records, then slice minibatches in the same order, the module's loss, optimizer and
  ``lr_scheduler`` per epoch, the same evaluation (module metrics, averaged weighted by
  batch size) at each epoch end, ``torch.save(model.state_dict())`` at the end.

The figure is wall-clock training records per second, whole process included
(``epochs x training records / wall``); the ratio is candidate / baseline (>= 0.9
wanted), the median over rounds of per-round ratios. The same ratio of CPU seconds
(user + system of the process) is printed next to it: on a machine shared with other
work it says what the wall-clock figure would if both had the CPU alike. Cases:

* ``net``: pytorch/examples MNIST ``Net`` (``model_zoo/mnist/mnist_example.py``) on
  scikit-learn digits as 28x28 (``model_zoo/digits/prepare_data.py``);
* ``gpt2``: a 2-layer GPT-2 from a config (``benchmarks/e2e_zoo/gpt2_lm.py``,
  ``transformers``) on generated token sequences;
* ``deepfm``: torchfm's DeepFM (``model_zoo/deepfm/deepfm_torchfm.py``) on a generated
  click log (``model_zoo/deepfm/gen_data.py``).

Run: python benchmarks/end_to_end.py [--cases net,gpt2,deepfm] [--rounds 3] [--threads 1]
     [--workdir DIR] [--smoke]
Prints a line per run, a table, and the summary as a JSON last line.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_ZOO = os.path.join(ROOT, "model_zoo")
BENCH_ZOO = os.path.join(ROOT, "benchmarks", "e2e_zoo")


@dataclass(frozen=True)
class Case:
    zoo: str
    model_def: str
    epochs: int
    batch: int
    records: int = 0          # generated data: how many (0: the dataset's own)


CASES = {
    "net": Case(MODEL_ZOO, "mnist.mnist_example.custom_model", epochs=2, batch=64),
    "gpt2": Case(BENCH_ZOO, "gpt2_lm.custom_model", epochs=2, batch=32, records=1500),
    "deepfm": Case(MODEL_ZOO, "deepfm.deepfm_torchfm.custom_model", epochs=1, batch=256,
                   records=20_000),
}
SMOKE = {"net": Case(MODEL_ZOO, "mnist.mnist_example.custom_model", epochs=1, batch=32,
                    records=192)}


def prepare(name: str, case: Case, data: str) -> None:
    if os.path.isdir(os.path.join(data, "train")):
        return
    if name == "net":
        subprocess.run([sys.executable, os.path.join(MODEL_ZOO, "digits", "prepare_data.py"),
                        f"--output={data}"], check=True, capture_output=True, timeout=600)
        if case.records:  # the first records of each file only
            _truncate(os.path.join(data, "train"), case.records)
            _truncate(os.path.join(data, "val"), max(case.records // 4, 1))
        return
    if name == "deepfm":
        cmd = [os.path.join(MODEL_ZOO, "deepfm", "gen_data.py"), f"--output={data}",
               f"--num_records={case.records}", "--num_files=2"]
    else:
        sys.path.insert(0, BENCH_ZOO)
        import gpt2_lm

        gpt2_lm.write_data(os.path.join(data, "train"), case.records)
        gpt2_lm.write_data(os.path.join(data, "val"), case.records // 10, seed=1)
        return
    subprocess.run([sys.executable, *cmd], check=True, capture_output=True, timeout=600)


def _truncate(directory: str, records: int) -> None:
    import numpy as np

    files = sorted(glob.glob(os.path.join(directory, "*.npz")))
    for path in files:
        with np.load(path) as f:
            arrays = {k: f[k][:max(records // len(files), 1)] for k in f.files}
        np.savez(path, **arrays)


def count_records(directory: str) -> int:
    import numpy as np

    total = 0
    for path in sorted(glob.glob(os.path.join(directory, "*.npz"))):
        with np.load(path) as f:
            total += len(f[f.files[0]])
    return total


# ------------------------------------------------------------ the baseline: a plain loop
def plain_loop(a: argparse.Namespace) -> None:
    """A plain PyTorch loop over the same data, model module and epochs."""
    import numpy as np
    import torch

    case = CASES[a.plain]
    sys.path.insert(0, case.zoo)
    module = importlib.import_module(case.model_def.rsplit(".", 1)[0])

    def load(split: str, mode: str) -> tuple[Any, Any]:
        arrays: dict[str, list] = {}
        for path in sorted(glob.glob(os.path.join(a.data, split, "*.npz"))):
            with np.load(path) as f:
                for k in f.files:
                    arrays.setdefault(k, []).append(f[k])
        cols = {k: np.concatenate(v) for k, v in arrays.items()}
        n = len(next(iter(cols.values())))
        return module.feed([{k: c[i] for k, c in cols.items()} for i in range(n)], mode)

    torch.manual_seed(0)
    model = getattr(module, case.model_def.rsplit(".", 1)[1])()
    opt = module.optimizer(model.parameters())
    sched = module.lr_scheduler(opt) if hasattr(module, "lr_scheduler") else None
    metrics = module.eval_metrics_fn()
    x, y = load("train", "training")
    xv, yv = load("val", "evaluation")
    evaluations = []
    for _ in range(case.epochs):
        model.train()
        for i in range(0, len(y), case.batch):
            opt.zero_grad(set_to_none=True)
            module.loss(y[i:i + case.batch], model(x[i:i + case.batch])).backward()
            opt.step()
        if sched is not None:
            sched.step()
        model.eval()
        sums = dict.fromkeys(metrics, 0.0)
        with torch.no_grad():
            for i in range(0, len(yv), case.batch):
                out, labels = model(xv[i:i + case.batch]), yv[i:i + case.batch]
                for k, fn in metrics.items():
                    sums[k] += float(fn(labels, out)) * len(labels)
        evaluations.append({k: v / len(yv) for k, v in sums.items()})
    os.makedirs(a.output, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(a.output, "model.pt"))
    print(json.dumps({"final_metrics": evaluations[-1]}))


# ------------------------------------------------------------------------ the parent
def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, Any]:
    """Run ``cmd``; its wall-clock seconds, CPU seconds (user + system) and result."""
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    wall = time.monotonic() - start
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime
    return wall, cpu, done


def run_plain(name: str, case: Case, data: str, out: str, env: dict[str, str]
              ) -> tuple[float, float, dict]:
    wall, cpu, done = timed([sys.executable, os.path.abspath(__file__), f"--plain={name}",
                             f"--data={data}", f"--output={out}"], env)
    if done.returncode:
        raise SystemExit(f"plain loop {name} failed:\n{done.stderr[-3000:]}")
    return wall, cpu, json.loads(done.stdout.strip().splitlines()[-1])["final_metrics"]


def run_local(name: str, case: Case, data: str, out: str, env: dict[str, str]
              ) -> tuple[float, float, dict]:
    cmd = [sys.executable, "-m", "elasticdl_client.main", "train", f"--model_zoo={case.zoo}",
           f"--model_def={case.model_def}", f"--training_data={data}/train",
           f"--validation_data={data}/val", f"--num_epochs={case.epochs}",
           f"--minibatch_size={case.batch}", f"--output={out}", f"--job_name=e2e-{name}",
           "--distribution_strategy=Local"]
    wall, cpu, done = timed(cmd, env)
    if done.returncode:
        raise SystemExit(f"elasticdl Local {name} failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "job_report.json")) as f:
        report = json.load(f)
    assert report["status"] == "succeeded", report
    return wall, cpu, report["final_metrics"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="net,gpt2,deepfm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default="", help="keep the generated data here")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of both sides "
                    "(1: steadier on a loaded machine; 0: torch's default)")
    ap.add_argument("--smoke", action="store_true", help="seconds: net, 1 epoch, 1 round")
    ap.add_argument("--plain", default="", help=argparse.SUPPRESS)
    ap.add_argument("--data", default="", help=argparse.SUPPRESS)
    ap.add_argument("--output", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.smoke:
        CASES.clear()
        CASES.update(SMOKE)
        a.cases, a.rounds = ",".join(SMOKE), 1
    if a.plain:
        plain_loop(a)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = a.workdir or tmp
        env = {**os.environ, "PYTHONPATH": ROOT, "ELASTICDL_HOME": os.path.join(tmp, "home")}
        if a.threads:
            env["OMP_NUM_THREADS"] = str(a.threads)
        summary: dict[str, Any] = {}
        for name in a.cases.split(","):
            case = CASES[name]
            data = os.path.join(work, f"data-{name}-{case.records}")
            prepare(name, case, data)
            records = count_records(os.path.join(data, "train")) * case.epochs
            plain_t, local_t, ratios, cpu_ratios = [], [], [], []
            for r in range(a.rounds):
                first_plain = r % 2 == 0
                got = {}
                for kind in (("plain", "local") if first_plain else ("local", "plain")):
                    out = os.path.join(tmp, f"{name}-{kind}-{r}")
                    run = run_plain if kind == "plain" else run_local
                    got[kind] = run(name, case, data, out, env)
                plain_t.append(got["plain"][0])
                local_t.append(got["local"][0])
                ratios.append(plain_t[-1] / local_t[-1])
                cpu_ratios.append(got["plain"][1] / got["local"][1])
                print(f"{name} round {r}: plain {records / plain_t[-1]:8.0f} rec/s "
                      f"({plain_t[-1]:.1f} s, cpu {got['plain'][1]:.1f} s, "
                      f"{fmt(got['plain'][2])}), Local {records / local_t[-1]:8.0f} rec/s "
                      f"({local_t[-1]:.1f} s, cpu {got['local'][1]:.1f} s, "
                      f"{fmt(got['local'][2])})", flush=True)
            summary[name] = {"records": records, "epochs": case.epochs, "batch": case.batch,
                             "plain_rec_s": round(records / statistics.median(plain_t), 1),
                             "local_rec_s": round(records / statistics.median(local_t), 1),
                             "ratio": round(statistics.median(ratios), 3),
                             "cpu_ratio": round(statistics.median(cpu_ratios), 3),
                             "plain_s": [round(t, 2) for t in plain_t],
                             "local_s": [round(t, 2) for t in local_t]}
    print(f"\n{'case':8} {'records':>8} {'plain rec/s':>12} {'Local rec/s':>12} "
          f"{'Local/plain':>12} {'(CPU time)':>11}  (medians of {a.rounds} alternating "
          "rounds; target >= 0.9)")
    for name, s in summary.items():
        print(f"{name:8} {s['records']:8d} {s['plain_rec_s']:12.0f} {s['local_rec_s']:12.0f} "
              f"{s['ratio']:11.2f}x {s['cpu_ratio']:10.2f}x")
    print(json.dumps(summary))
    return 0


def fmt(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))


if __name__ == "__main__":
    sys.exit(main())
