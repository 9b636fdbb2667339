"""A PS job with a lazy table of 2^31 ids (issue 28): it ends succeeded, its export holds
only the rows that exist (model.pt the dense part), and `elasticdl predict` from the
export gives the trained model's outputs (the training job's own final evaluation on the
PS, over the same records, including ids never trained); `elasticdl evaluate` from the
export and `elasticdl predict` from the final PS checkpoint agree."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from elasticdl.common.sparse_tables import export_bytes, read_manifest
from elasticdl.worker.prediction import read_predictions
from tests.conftest import FIXTURE_ZOO
from tests.integration.helpers import kill_job_tree, read_json, start_cli

pytestmark = pytest.mark.integration

VOCAB = 3000


def _run(args: list[str], tmp_path, name: str) -> None:
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / f"{name}.log"))
    try:
        assert proc.wait(timeout=420) == 0, (tmp_path / f"{name}.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, str(tmp_path / name))


def test_lazy_2_31_table_exports_its_rows_and_predicts_from_them(tmp_path):
    if FIXTURE_ZOO not in sys.path:
        sys.path.insert(0, FIXTURE_ZOO)
    from toy import lazy_bags

    train = lazy_bags.write_data(str(tmp_path / "train"), 2048, VOCAB, seed=0)
    # validation = prediction data: trained ids and ids never trained (other seed, pool)
    val = lazy_bags.write_data(str(tmp_path / "val"), 512, 2 * VOCAB, seed=1)
    common = [f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.lazy_bags.custom_model",
              "--cluster=local", "--minibatch_size=64"]
    job = str(tmp_path / "train-job")
    _run(["train", *common, f"--training_data={tmp_path / 'train'}",
          f"--validation_data={tmp_path / 'val'}", f"--output={job}", "--job_name=lazy",
          "--distribution_strategy=ParameterServerStrategy", "--num_workers=2",
          "--num_ps_pods=2", "--num_minibatches_per_task=4",
          f"--checkpoint_dir={tmp_path / 'ckpt'}", "--checkpoint_steps=1000"],
         tmp_path, "train-job")
    report = read_json(os.path.join(job, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    trained = report["final_metrics"]

    table = read_manifest(job)["bag.weight"]
    assert table["spec"].num_embeddings == 1 << 31
    assert table["rows"] == np.unique(train[:, :3]).shape[0]   # the rows that exist
    size = export_bytes(job)
    assert size < 2 * table["rows"] * 8 * 4 + (1 << 20)
    print(f"sparse export: {table['rows']} rows of 2^31, {size} bytes on disk; model.pt "
          f"{os.path.getsize(os.path.join(job, 'model.pt'))} bytes")
    logs = os.path.join(job, "logs")
    peak = [line.split("peak RSS of this process so far ")[1].strip()
            for name in os.listdir(logs) if name.startswith("worker-")
            for line in open(os.path.join(logs, name))
            if "sparse export written" in line]
    assert len(peak) == 1, peak
    print(f"exporting worker's peak RSS (whole run, training included): {peak[0]}")
    assert float(peak[0].split()[0]) < 2048   # the whole table would be 64 GiB
    state = torch.load(os.path.join(job, "model.pt"), weights_only=True)
    assert set(state) == {"fc.weight", "fc.bias"}

    pred = str(tmp_path / "pred")
    _run(["predict", *common, f"--prediction_data={tmp_path / 'val'}",
          f"--checkpoint_dir_for_init={job}", f"--output={pred}", "--job_name=lazy-pred"],
         tmp_path, "pred")
    outputs = {int(i): float(o) for _, idx, out in read_predictions(pred)
               for i, o in zip(idx, np.asarray(out).reshape(-1))}
    assert sorted(outputs) == list(range(val.shape[0]))
    out = np.array([outputs[i] for i in range(val.shape[0])])
    assert abs(out.mean() - trained["mean_output"]) < 1e-5, (out.mean(), trained)
    assert abs((out ** 2).mean() - trained["mean_sq_output"]) < 1e-5, trained

    # evaluate from the export, and predict from the final PS checkpoint (its big table
    # read as the checkpoint's rows): the same model
    _run(["evaluate", *common, f"--validation_data={tmp_path / 'val'}",
          f"--checkpoint_dir_for_init={job}", f"--output={tmp_path / 'eval'}",
          "--job_name=lazy-eval"], tmp_path, "eval")
    evaluated = read_json(os.path.join(tmp_path / "eval", "job_report.json"))["final_metrics"]
    for name in ("mean_output", "mean_sq_output"):
        assert abs(evaluated[name] - trained[name]) < 1e-5, (evaluated, trained)
    _run(["predict", *common, f"--prediction_data={tmp_path / 'val'}",
          f"--checkpoint_dir_for_init={tmp_path / 'ckpt'}", f"--output={tmp_path / 'pred2'}",
          "--job_name=lazy-pred2"], tmp_path, "pred2")
    from_ckpt = {int(i): float(o) for _, idx, out in read_predictions(str(tmp_path / "pred2"))
                 for i, o in zip(idx, np.asarray(out).reshape(-1))}
    np.testing.assert_allclose([from_ckpt[i] for i in range(val.shape[0])], out, rtol=1e-5,
                               atol=1e-6)

    from elasticdl.api.sparse_export import load_model

    model = load_model(job, lazy_bags.custom_model).eval()   # the documented loader
    with torch.no_grad():
        again = model(torch.from_numpy(val[:, :3].copy())).numpy()
    np.testing.assert_allclose(again, out, rtol=1e-5, atol=1e-6)
