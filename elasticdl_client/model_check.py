"""Checks of the model module and flags that run in the ``elasticdl`` command before
any replica is launched, so a deterministic error costs seconds, not a cluster start.
"""

from __future__ import annotations

from elasticdl.common.enums import ClusterKind, JobType
from elasticdl.common.job_spec import JobSpec


class LaunchCheckError(ValueError):
    """The job cannot run as configured; the message names the flag or function."""


def check_before_launch(spec: JobSpec) -> None:
    """Load the model module (local cluster jobs: the zoo is on this machine) and
    check what would fail at every replica's start.

    Raises:
        ModelSpecError: the module breaks the contract, or defines ``train_loop``
            for a strategy that does not run it.
        LaunchCheckError: ``--amp=fp16`` on a machine without CUDA.
    """
    if spec.cluster != ClusterKind.LOCAL:
        return  # the image holds the zoo; the workers check at their start
    if spec.amp == "fp16" and spec.device != "cuda":
        import torch

        if spec.device == "cpu" or not torch.cuda.is_available():
            raise LaunchCheckError("--amp=fp16 needs CUDA (float16 autocast with a "
                                   "GradScaler) and this job trains on the CPU: use "
                                   "--amp=bf16 or --amp=off")
    if spec.job_type != JobType.TRAIN:
        return
    from elasticdl.api.model_spec import load_from_job_spec
    from elasticdl.worker.runtime import check_train_loop_supported

    check_train_loop_supported(load_from_job_spec(spec), spec)
