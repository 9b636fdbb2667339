"""``--checkpoint_dir`` / ``--checkpoint_dir_for_init`` as object-storage URLs.

For the jobs this client runs (Local, ``--cluster=local``) the job gets local staging
directories in their place, the checkpoint to resume from is downloaded first, and a mirror
thread keeps the staging directory and the bucket in step while the job runs and once more at
its end (:mod:`elasticdl.checkpoint.staging`). A Kubernetes job's pods stage for themselves
(each its own directory, the pods share no disk); the client only checks the bucket before
submitting: an earlier run's checkpoints, or nothing to resume from, refuse the job here.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from elasticdl.checkpoint import remote, staging
from elasticdl.common.enums import ClusterKind
from elasticdl.common.job_dirs import elasticdl_home
from elasticdl.common.job_spec import JobSpec
from elasticdl.data import fs

logger = logging.getLogger(__name__)


def _check_for_pods(spec: JobSpec) -> None:
    ckpt, init = spec.checkpoint_dir, spec.checkpoint_dir_for_init
    if remote.is_remote(ckpt):
        staging.refuse_earlier_run(spec)
    if remote.is_remote(init):
        remote.named_version(init)   # CheckpointError: nothing complete to resume from


@contextlib.contextmanager
def staged(spec: JobSpec) -> Iterator[JobSpec]:
    """``spec`` with local staging directories in place of checkpoint URLs, for the time of
    the job; uploads what the job wrote when it ends (also when it fails). On Kubernetes:
    ``spec`` itself, once the bucket is checked.

    Raises:
        CheckpointError: nothing complete to resume from, or ``--checkpoint_dir`` holding an
            earlier run's checkpoints.
        DataError: the store cannot be read or written (names the URL).
    """
    if not (remote.is_remote(spec.checkpoint_dir) or
            remote.is_remote(spec.checkpoint_dir_for_init)):
        yield spec
        return
    fs.configure_from_spec(spec)    # --data_endpoint serves checkpoints too
    if spec.cluster == ClusterKind.K8S:
        _check_for_pods(spec)
        yield spec
        return
    root = os.path.join(elasticdl_home(), "checkpoint-staging", spec.job_name)
    try:
        yield staging.stage(spec, root)
    finally:
        done = staging.stop_all()
        if remote.is_remote(spec.checkpoint_dir):
            logger.info("checkpoint versions completed in %s: %s",
                        fs.redact(spec.checkpoint_dir), done)
