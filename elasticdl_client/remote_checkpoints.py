"""``--checkpoint_dir`` / ``--checkpoint_dir_for_init`` as object-storage URLs, for the jobs
this client runs (Local, ``--cluster=local``): the job gets local staging directories in
their place, the checkpoint to resume from is downloaded first, and a mirror thread uploads
each complete version (``DONE`` last) while the job runs and once more at its end
(:mod:`elasticdl.checkpoint.remote`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from typing import Any

from elasticdl.checkpoint import remote
from elasticdl.checkpoint.paths import CheckpointError
from elasticdl.common.enums import ClusterKind
from elasticdl.common.job_dirs import elasticdl_home
from elasticdl.common.job_spec import JobSpec
from elasticdl.data import fs

logger = logging.getLogger(__name__)


def _inside(init_url: str, ckpt_url: str) -> bool:
    init, ckpt = fs.normalize(init_url), fs.normalize(ckpt_url)
    return init == ckpt or init.rpartition("/")[0] == ckpt


@contextlib.contextmanager
def staged(spec: JobSpec) -> Iterator[JobSpec]:
    """``spec`` with local staging directories in place of checkpoint URLs, for the time of
    the job; uploads what the job wrote when it ends (also when it fails).

    Raises:
        CheckpointError: a URL on Kubernetes (not supported yet), nothing complete to resume
            from, or ``--checkpoint_dir`` holding an earlier run's checkpoints.
        DataError: the store cannot be read or written (names the URL).
    """
    ckpt, init = spec.checkpoint_dir, spec.checkpoint_dir_for_init
    if not (remote.is_remote(ckpt) or remote.is_remote(init)):
        yield spec
        return
    fs.configure_from_spec(spec)    # --data_endpoint serves checkpoints too
    if spec.cluster == ClusterKind.K8S:
        raise CheckpointError("object-storage checkpoint URLs work for Local and "
                              "--cluster=local jobs only for now (docs/data.md); on "
                              "Kubernetes use a volume (--volume)")
    root = os.path.join(elasticdl_home(), "checkpoint-staging", spec.job_name)
    changes: dict[str, Any] = {}
    already: list[int] = []
    if remote.is_remote(ckpt):
        local_ckpt = remote.staging_dir(root, ckpt, "checkpoints")
        changes["checkpoint_dir"] = local_ckpt
        already = remote.remote_versions(ckpt)
        if already and not (init and _inside(init, ckpt)):
            raise CheckpointError(
                f"--checkpoint_dir {fs.redact(ckpt)} already holds complete checkpoints "
                f"(versions {already[:5]}); resume from it with --checkpoint_dir_for_init="
                f"{fs.redact(ckpt)} or pick a new prefix")
    if remote.is_remote(init):
        if remote.is_remote(ckpt) and _inside(init, ckpt):
            local = remote.download_checkpoint(init, changes["checkpoint_dir"])
            changes["checkpoint_dir_for_init"] = local if init.rstrip("/").rsplit(
                "/", 1)[-1].startswith("version-") else changes["checkpoint_dir"]
        else:
            changes["checkpoint_dir_for_init"] = remote.download_checkpoint(
                init, remote.staging_dir(root, init, "init"))
    staged_spec = dataclasses.replace(spec, **changes)
    mirror = None
    if remote.is_remote(ckpt):
        logger.info("checkpoints staged in %s and uploaded to %s", changes["checkpoint_dir"],
                    fs.redact(ckpt))
        mirror = remote.CheckpointMirror(changes["checkpoint_dir"], ckpt, already=already,
                                         keep_max=spec.keep_checkpoint_max).start()
    try:
        yield staged_spec
    finally:
        if mirror is not None:
            uploaded = mirror.stop()
            logger.info("checkpoint versions in %s: %s", fs.redact(ckpt), uploaded)
