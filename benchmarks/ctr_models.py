"""CTR models as published, trained three ways on the same generated Criteo-shaped data.

Models (``--models``): facebookresearch/dlrm's ``DLRM_Net``
(``benchmarks/ctr_zoo/dlrm_s_pytorch.py``, vendored unmodified): 26
``nn.EmbeddingBag(n, 16, mode="sum", sparse=True)`` tables (about
``--table_rows`` rows in all, Zipf ids), bottom MLP 13-64-16, dot interaction, top MLP
367-64-1, upstream's ``torch.optim.SGD`` (lr 0.1 here) and BCE. The model module
(``ctr_zoo/dlrm_criteo.py``) only supplies feed/loss/optimizer/metrics; no torch class is
patched and there is no adapter model: under ParameterServerStrategy torch's own tables
become row-sharded PS tables (issue 28). And torchfm's ``DeepFactorizationMachineModel``
(``ctr_zoo/torchfm_dfm.py``, vendored unmodified): two ``torch.nn.Embedding`` tables of
``sum(field_dims)`` rows over the 26 categorical fields, FM + MLP(64, 64) with BatchNorm.
And DeepCTR-Torch's ``DeepFM`` (``ctr_zoo/deepctr_criteo.py``: the ``deepctr-torch``
package as published, imported): 26 ``SparseFeat`` of dim 16 and 13 ``DenseFeat``, its
``nn.Embedding`` tables in ``ModuleDict``s (dim 16 for FM/DNN, dim 1 for the linear
part), DNN (64, 64).

Runs, same records, same effective batch (``--batch``), one pass:

* ``plain``: a plain PyTorch loop in this process (training time only);
* ``Local``: ``elasticdl train --distribution_strategy=Local`` (the CLI, one process);
* ``PS``: ``elasticdl train --cluster=local --distribution_strategy=ParameterServerStrategy``
  with 2 workers x 2 PS, minibatch ``batch/2`` and ``--grads_to_wait=2`` (each version
  averages two pushes: the same 256 records per update);
* ``Allreduce``: ``--distribution_strategy=AllreduceStrategy`` with 2 members x ``batch/2``
  (sparse table gradients all-gathered as rows, dense ones reduced).

Each reports the exact validation AUC (``elasticdl.api.metrics.AUC``) and training
records/s (the jobs' ``timings.training_records_per_s``); the PS job also its sparse
export. The last line is JSON.

Run: python benchmarks/ctr_models.py [--records 100000] [--table_rows 4200000] [--smoke]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

MODELS = {"dlrm": "ctr_zoo.dlrm_criteo", "deepfm": "ctr_zoo.deepfm_criteo",
          "deepctr": "ctr_zoo.deepctr_criteo"}


def _zoo(model: str) -> Any:
    import importlib

    return importlib.import_module(MODELS[model])


def plain_loop(model_name: str, train: str, val: str, sizes: list[int], batch: int,
               seed: int) -> dict[str, Any]:
    import numpy as np
    import torch

    zoo = _zoo(model_name)
    torch.manual_seed(seed)
    model = zoo.build(sizes, seed)
    opt = zoo.optimizer(model.parameters())
    with np.load(os.path.join(train, "part-0.npz")) as z:
        data = {k: z[k] for k in z.files}
    n = data["label"].shape[0]
    start = time.perf_counter()
    for lo in range(0, n, batch):
        features, labels = zoo.batch(data["dense"][lo:lo + batch], data["cat"][lo:lo + batch],
                                     data["label"][lo:lo + batch])
        opt.zero_grad()
        zoo.loss(labels, model(*features)).backward()
        opt.step()
    wall = time.perf_counter() - start
    return {"auc": evaluate(zoo, model, val, batch), "records_per_s": round(n / wall, 1)}


def evaluate(zoo: Any, model: Any, val: str, batch: int) -> float:
    import numpy as np
    import torch

    from elasticdl.api.metrics import AUC

    auc = AUC()
    with np.load(os.path.join(val, "part-0.npz")) as z:
        data = {k: z[k] for k in z.files}
    model.eval()
    with torch.no_grad():
        for lo in range(0, data["label"].shape[0], batch):
            features, labels = zoo.batch(data["dense"][lo:lo + batch],
                                         data["cat"][lo:lo + batch],
                                         data["label"][lo:lo + batch])
            auc.update(labels, model(*features))
    return float(auc.compute())


def _task_minibatches(train: str, batch: int) -> int:
    """Minibatches a task: 16, fewer where the log holds under 8 such tasks (the smoke's
    1,024 records made one task: the second PS worker idled and every sync version
    waited out its group timeout for a push that never came, 80 s of a 160 s smoke)."""
    import numpy as np

    with np.load(os.path.join(train, "part-0.npz")) as z:
        records = int(z["label"].shape[0])
    return max(1, min(16, records // (8 * batch)))


def _flags(model: str, train: str, val: str, sizes: list[int], batch: int,
           seed: int) -> list[str]:
    return ["train", f"--model_zoo={HERE}", f"--model_def={MODELS[model]}.custom_model",
            f"--model_params=sizes={'-'.join(map(str, sizes))};seed={seed}",
            f"--training_data={train}", f"--validation_data={val}",
            f"--minibatch_size={batch}", f"--eval_minibatch_size={1024}",
            f"--num_minibatches_per_task={_task_minibatches(train, batch)}", f"--seed={seed}",
            "--device=cpu"]


def _report(out: str) -> dict[str, Any]:
    with open(os.path.join(out, "job_report.json")) as f:
        report = json.load(f)
    if report["status"] != "succeeded":
        raise RuntimeError(f"{out}: job {report['status']}: {report.get('failure')}")
    return report


def local_job(tmp: str, model: str, train: str, val: str, sizes: list[int], batch: int,
              seed: int) -> dict[str, Any]:
    out = os.path.join(tmp, f"{model}-local")
    env = dict(os.environ, PYTHONPATH=ROOT, ELASTICDL_HOME=os.path.join(tmp, "home"))
    subprocess.run([sys.executable, "-m", "elasticdl_client.main",
                    *_flags(model, train, val, sizes, batch, seed), f"--output={out}",
                    f"--job_name={model}-local", "--distribution_strategy=Local"],
                   check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    report = _report(out)
    return {"auc": report["final_metrics"]["auc"],
            "records_per_s": report["timings"]["training_records_per_s"]}


def _cli_job(tmp: str, model: str, name: str, flags: list[str]) -> dict[str, Any]:
    """A ``--cluster=local`` CLI job to its end; its report (raises with its log's tail)."""
    out = os.path.join(tmp, f"{model}-{name}")
    env = dict(os.environ, PYTHONPATH=ROOT, ELASTICDL_HOME=os.path.join(tmp, "home"))
    log = os.path.join(tmp, f"{model}-{name}-cli.log")
    with open(log, "wb") as f:
        code = subprocess.run([sys.executable, "-m", "elasticdl_client.main", *flags,
                               f"--output={out}", f"--job_name={model}-{name}",
                               "--cluster=local"], env=env, cwd=ROOT, stdout=f,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        with open(log) as f:
            raise RuntimeError(f"{name} job exited {code}:\n{f.read()[-3000:]}")
    report = _report(out)
    report["out"] = out
    return report


PS_MODE = {"sync": ["--grads_to_wait=2"], "async": ["--use_async=true"]}


def ps_job(tmp: str, model: str, train: str, val: str, sizes: list[int], batch: int,
           seed: int, mode: str = "sync") -> dict[str, Any]:
    from elasticdl.common.sparse_tables import export_bytes, has_sparse_export, read_manifest

    report = _cli_job(tmp, model, f"ps-{mode}", [
        *_flags(model, train, val, sizes, batch // 2, seed),
        "--distribution_strategy=ParameterServerStrategy",
        "--num_workers=2", "--num_ps_pods=2", *PS_MODE[mode]])
    out = report["out"]
    result = {"auc": report["final_metrics"]["auc"],
              "records_per_s": report["timings"]["training_records_per_s"],
              "model_pt_bytes": os.path.getsize(os.path.join(out, "model.pt"))}
    if has_sparse_export(out):
        result["sparse_tables"] = {n: e["rows"] for n, e in read_manifest(out).items()}
        result["sparse_export_bytes"] = export_bytes(out)
    return result


def allreduce_job(tmp: str, model: str, train: str, val: str, sizes: list[int], batch: int,
                  seed: int) -> dict[str, Any]:
    """2 members x ``batch/2``: the tables' sparse gradients all-gathered as rows (issue
    28), the dense ones reduced; every member holds every table."""
    report = _cli_job(tmp, model, "allreduce", [
        *_flags(model, train, val, sizes, batch // 2, seed),
        "--distribution_strategy=AllreduceStrategy", "--num_workers=2"])
    return {"auc": report["final_metrics"]["auc"],
            "records_per_s": report["timings"]["training_records_per_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=100_000, help="training records")
    p.add_argument("--val_records", type=int, default=20_000)
    p.add_argument("--table_rows", type=int, default=4_200_000, help="rows of all 26 tables")
    p.add_argument("--batch", type=int, default=256, help="effective batch of every run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default="plain,Local,PS,Allreduce")
    p.add_argument("--models", default="", help="dlrm (facebookresearch/dlrm DLRM_Net), "
                   "deepfm (torchfm DeepFactorizationMachineModel), deepctr (DeepCTR-Torch "
                   "DeepFM); default all three (--smoke: dlrm)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    a = p.parse_args()
    if a.smoke:
        a.records, a.val_records, a.table_rows, a.batch = 1024, 256, 26 * 100, 128
    a.models = a.models or ("dlrm" if a.smoke else "dlrm,deepfm,deepctr")
    from ctr_zoo import criteo_gen

    sizes = criteo_gen.table_sizes(a.table_rows)
    results: dict[str, Any] = {"records": a.records, "val_records": a.val_records,
                               "table_rows": sum(sizes), "batch": a.batch}
    with tempfile.TemporaryDirectory(prefix="ctr-models-") as tmp:
        train, val = os.path.join(tmp, "train"), os.path.join(tmp, "val")
        criteo_gen.write(train, a.records, sizes, a.seed)
        criteo_gen.write(val, a.val_records, sizes, a.seed + 1)
        for model in a.models.split(","):
            results[model] = out = {}
            for name in a.runs.split(","):
                start = time.perf_counter()
                args = (model, train, val, sizes, a.batch, a.seed)
                out[name] = plain_loop(*args) if name == "plain" else \
                    {"Local": local_job, "PS": ps_job, "Allreduce": allreduce_job,
                     "PS-async": functools.partial(ps_job, mode="async")}[name](tmp, *args)
                out[name]["wall_s"] = round(time.perf_counter() - start, 1)
                print(f"[{model} {name}] {out[name]}", flush=True)
            for ps in ("PS", "PS-async"):
                if ps in out and "Local" in out:
                    out[f"{ps.lower()}_over_local_records_per_s"] = round(
                        out[ps]["records_per_s"] / out["Local"]["records_per_s"], 3)
            if "plain" in out:
                out["auc_minus_plain"] = {k: round(out[k]["auc"] - out["plain"]["auc"], 4)
                                          for k in ("Local", "PS", "PS-async", "Allreduce")
                                          if k in out}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
