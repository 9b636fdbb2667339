"""What the CLI checks before launching any replica (issue 15, items 2 and 4)."""

from __future__ import annotations

import pytest
import torch

from elasticdl.api.model_spec import ModelSpecError
from elasticdl.common.job_spec import job_spec_from_flags
from elasticdl_client.model_check import LaunchCheckError, check_before_launch
from tests.conftest import MODEL_ZOO


def _spec(**extra):
    flags = {"model_zoo": MODEL_ZOO, "model_def": "mnist.mnist_custom_loop.custom_model",
             "training_data": "/nonexistent", "cluster": "local"}
    flags.update(extra)
    return job_spec_from_flags("train", flags)


def test_train_loop_under_ps_names_module_and_strategies():
    with pytest.raises(ModelSpecError) as e:
        check_before_launch(_spec(distribution_strategy="ParameterServerStrategy",
                                  num_workers=2, num_ps_pods=1))
    msg = str(e.value)
    assert "mnist_custom_loop.py defines train_loop(ctx)" in msg
    assert "Local or AllreduceStrategy" in msg


@pytest.mark.parametrize("strategy", ["Local", "AllreduceStrategy"])
def test_train_loop_is_accepted_where_it_runs(strategy):
    check_before_launch(_spec(distribution_strategy=strategy))


def test_ps_without_train_loop_passes():
    check_before_launch(_spec(model_def="mnist.mnist_example.custom_model",
                              distribution_strategy="ParameterServerStrategy",
                              num_workers=2, num_ps_pods=1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_fp16_without_cuda_fails_naming_the_flag():
    with pytest.raises(LaunchCheckError, match="--amp=fp16 needs CUDA"):
        check_before_launch(_spec(model_def="mnist.mnist_example.custom_model", amp="fp16"))
    with pytest.raises(LaunchCheckError, match="--amp=fp16"):
        check_before_launch(_spec(model_def="mnist.mnist_example.custom_model", amp="fp16",
                                  device="cpu"))


def test_a_large_plain_nn_embedding_under_ps_is_warned_about(tmp_path, caplog):
    """A plain torch.nn.Embedding stays a dense parameter under PS (whole table pulled and
    pushed every step): the client says so and names the drop-in."""
    (tmp_path / "dense_table.py").write_text(
        "import torch\n"
        "def custom_model():\n"
        "    return torch.nn.Sequential(torch.nn.Embedding(65536, 16))\n"
        "def loss(labels, outputs):\n    return outputs.sum()\n"
        "def optimizer(params):\n    return torch.optim.SGD(params, lr=0.1)\n"
        "def feed(records, mode):\n    return records, None\n")
    spec = job_spec_from_flags("train", {
        "model_zoo": str(tmp_path), "model_def": "dense_table.custom_model",
        "training_data": "/nonexistent", "cluster": "local",
        "distribution_strategy": "ParameterServerStrategy", "num_workers": 2})
    with caplog.at_level("WARNING", logger="elasticdl_client.model_check"):
        check_before_launch(spec)
    assert any("65536 x 16 is a dense parameter" in r.getMessage() and
               "elasticdl.api.layers.Embedding" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="elasticdl_client.model_check"):
        check_before_launch(job_spec_from_flags("train", {
            "model_zoo": str(tmp_path), "model_def": "dense_table.custom_model",
            "training_data": "/nonexistent", "cluster": "local",
            "distribution_strategy": "AllreduceStrategy", "num_workers": 2}))
    assert not caplog.records


def test_a_fresh_run_into_an_earlier_runs_checkpoints_is_refused(tmp_path):
    """A relaunched PS restores the newest checkpoint of its own --checkpoint_dir, so a new
    run must not start over an earlier run's checkpoints (it would take that model as its
    own): refused before launch unless it resumes from them."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "version-150").mkdir(parents=True)
    spec = _spec(model_def="mnist.mnist_example.custom_model", checkpoint_dir=str(ckpt),
                 distribution_strategy="ParameterServerStrategy", num_workers=2)
    check_before_launch(spec)   # incomplete (no DONE): not a checkpoint yet
    (ckpt / "version-150" / "DONE").write_text("")
    with pytest.raises(LaunchCheckError, match="version-150.*--checkpoint_dir_for_init="):
        check_before_launch(spec)
    check_before_launch(_spec(model_def="mnist.mnist_example.custom_model",
                              checkpoint_dir=str(ckpt), checkpoint_dir_for_init=str(ckpt),
                              distribution_strategy="ParameterServerStrategy", num_workers=2))
    other = tmp_path / "other"
    (other / "version-3").mkdir(parents=True)
    (other / "version-3" / "DONE").write_text("")
    with pytest.raises(LaunchCheckError, match="earlier run"):
        check_before_launch(_spec(model_def="mnist.mnist_example.custom_model",
                                  checkpoint_dir=str(ckpt), checkpoint_dir_for_init=str(other),
                                  distribution_strategy="ParameterServerStrategy",
                                  num_workers=2))
