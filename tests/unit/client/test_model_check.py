"""What the CLI checks before launching any replica (issue 15, items 2 and 4)."""

from __future__ import annotations

import os

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


def _table_zoo(tmp_path, table: str) -> str:
    """A zoo whose module (named after the test's directory: modules are cached by name)
    builds ``table`` as layer '1'."""
    (tmp_path / f"{tmp_path.name}.py").write_text(
        "import torch\n"
        "def custom_model():\n"
        f"    return torch.nn.Sequential(torch.nn.Linear(1, 1), {table})\n"
        "def loss(labels, outputs):\n    return outputs.sum()\n"
        "def optimizer(params):\n    return torch.optim.SGD(params, lr=0.1)\n"
        "def feed(records, mode):\n    return records, None\n")
    return str(tmp_path)


def _table_spec(zoo: str, strategy: str = "ParameterServerStrategy", **extra):
    return job_spec_from_flags("train", {
        "model_zoo": zoo, "model_def": f"{os.path.basename(zoo)}.custom_model",
        "training_data": "/nonexistent", "cluster": "local",
        "distribution_strategy": strategy, "num_workers": 2, **extra})


def test_a_large_torch_table_under_ps_is_a_ps_table_or_warned_about(tmp_path, caplog):
    """A torch nn.Embedding of >= --ps_table_min_elements becomes a PS table; one kept
    dense by a larger threshold is warned about (whole table pulled and pushed each step)."""
    zoo = _table_zoo(tmp_path, "torch.nn.Embedding(65536, 16)")
    with caplog.at_level("WARNING", logger="elasticdl_client.model_check"):
        check_before_launch(_table_spec(zoo))
    assert not caplog.records
    with caplog.at_level("WARNING", logger="elasticdl_client.model_check"):
        check_before_launch(_table_spec(zoo, ps_table_min_elements=2_000_000))
    assert any("Embedding of 65536 x 16 stays a dense parameter" in r.getMessage() and
               "--ps_table_min_elements=2000000" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="elasticdl_client.model_check"):
        check_before_launch(_table_spec(zoo, "AllreduceStrategy"))
    assert not caplog.records


@pytest.mark.parametrize("table,match", [
    ("torch.nn.EmbeddingBag(10, 4, max_norm=1.0, sparse=True)", "EmbeddingBag '1': max_norm"),
    ("torch.nn.Embedding.from_pretrained(torch.zeros(2**20, 1))", "Embedding '1': a frozen"),
])
def test_a_torch_table_the_ps_cannot_hold_is_refused_before_launch(tmp_path, table, match):
    with pytest.raises(ModelSpecError, match=match):
        check_before_launch(_table_spec(_table_zoo(tmp_path, table)))


def test_a_sparse_torch_table_kept_off_the_ps_is_refused_before_launch(tmp_path):
    zoo = _table_zoo(tmp_path, "torch.nn.EmbeddingBag(10, 4, sparse=True)")
    check_before_launch(_table_spec(zoo))   # sparse=True: a PS table whatever its size
    with pytest.raises(ModelSpecError, match="EmbeddingBag '1': sparse=True"):
        check_before_launch(_table_spec(zoo, ps_table_min_elements=-1))


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
