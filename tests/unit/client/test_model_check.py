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
