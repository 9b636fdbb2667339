"""Checkpoint URLs in the client: untouched specs without URLs, a clear refusal on
Kubernetes (each pod would need its own uploader)."""

from __future__ import annotations

import pytest

from elasticdl.checkpoint.paths import CheckpointError
from elasticdl.common.job_spec import JobSpec
from elasticdl_client.remote_checkpoints import staged


def _spec(**kw) -> JobSpec:
    return JobSpec(model_zoo="z", model_def="m.f", training_data="/d", **kw)


def test_plain_directories_pass_through(tmp_path):
    spec = _spec(checkpoint_dir=str(tmp_path / "ckpt"))
    with staged(spec) as got:
        assert got is spec


def test_kubernetes_refuses_checkpoint_urls():
    spec = _spec(checkpoint_dir="s3://b/ckpt", image_name="reg/x:1",
                 distribution_strategy="ParameterServerStrategy")
    with pytest.raises(CheckpointError, match="Local and --cluster=local jobs only"):
        with staged(spec):
            pass
