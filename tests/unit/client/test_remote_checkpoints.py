"""Checkpoint URLs in the client: untouched specs without URLs; on Kubernetes the spec goes
to the pods unchanged (each stages for itself) once the bucket is checked: an earlier run's
checkpoints, or nothing to resume from, refuse the job before anything is submitted."""

from __future__ import annotations

import os

import pytest

from elasticdl.checkpoint.paths import DONE, CheckpointError
from elasticdl.common.job_spec import JobSpec
from elasticdl_client.remote_checkpoints import staged
from tests.unit.checkpoint.test_pod_staging import bucket  # noqa: F401 - the fixture


def _spec(**kw) -> JobSpec:
    return JobSpec(model_zoo="z", model_def="m.f", training_data="/d", **kw)


def test_plain_directories_pass_through(tmp_path):
    spec = _spec(checkpoint_dir=str(tmp_path / "ckpt"))
    with staged(spec) as got:
        assert got is spec


def test_kubernetes_pods_get_the_urls_once_the_bucket_is_checked(bucket):  # noqa: F811
    spec = _spec(checkpoint_dir="s3://ckpt/run", image_name="reg/x:1",
                 distribution_strategy="ParameterServerStrategy")
    with staged(spec) as got:
        assert got is spec                       # an empty prefix: the pods stage
    vdir = os.path.join(bucket, "ckpt", "run", "version-4")
    os.makedirs(vdir)
    open(os.path.join(vdir, DONE), "w").close()
    with pytest.raises(CheckpointError, match="already holds complete checkpoints"):
        with staged(spec):
            pass
    resumed = spec.replace(checkpoint_dir_for_init="s3://ckpt/run")
    with staged(resumed) as got:
        assert got is resumed
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        with staged(spec.replace(checkpoint_dir="s3://ckpt/new",
                                 checkpoint_dir_for_init="s3://ckpt/nothing")):
            pass
