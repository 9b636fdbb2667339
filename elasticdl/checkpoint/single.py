"""Checkpoints as ``torch.save`` state dicts under ``<dir>/version-<N>/``.

One directory per model version holds one file per writer (``model.pt`` for a
single writer, ``ps-<i>-of-<n>.pt`` for parameter-server shards). A version is
complete once its ``DONE`` marker exists, so a crash mid-write never leaves a
checkpoint that a restore would pick. Retention keeps the newest
``keep_max`` complete versions (0 keeps all).
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Optional

import torch

from elasticdl.checkpoint import data_position, staging
from elasticdl.checkpoint.paths import (  # noqa: F401 - re-exported
    DONE,
    CheckpointError,
    complete_versions,
    resolve,
    version_dir,
    version_of,
)

logger = logging.getLogger(__name__)

WRITE_CHUNK = 1 << 20
"""Bytes per ``write`` system call of a checkpoint file (see :class:`ChunkedFile`)."""


class ChunkedFile:
    """A file ``torch.save`` writes through, a ``WRITE_CHUNK`` at a time.

    Given a path, ``torch.save`` hands each tensor's bytes to the kernel in one write (a
    PS's table: hundreds of MB). Writing ~1.4 GB that way from a thread of a process that
    also serves, the serving thread's 2 ms wake-ups were late by 10 ms at the 99th
    percentile throughout the write (2-core VM; 0.4 ms through this file), and the write
    itself took 2.3-4.8 s against 0.8 s (`benchmarks/ps_table_scale.py`: the hot round
    trips during a checkpoint). The bytes are the same file (``torch.load``, mapped or
    not, reads it as before); ``torch.save`` passes memory views, so nothing is copied.
    """

    def __init__(self, f: Any):
        self._f = f

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), WRITE_CHUNK):
            chunk = view[i:i + WRITE_CHUNK]
            while len(chunk):   # a short write (rare on a file) goes on where it stopped
                chunk = chunk[self._f.write(chunk):]
        return len(view)

    def __getattr__(self, name: str) -> Any:   # flush, seek, tell: the file's own
        return getattr(self._f, name)


def save_file(state: Any, path: str) -> None:
    """``torch.save`` to a temp file then rename: readers see old or new, never half."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb", buffering=0) as f:
        torch.save(state, ChunkedFile(f))
    os.replace(tmp, path)


def mark_done(checkpoint_dir: str, version: int, keep_max: int = 0) -> None:
    """Mark a version complete and apply retention."""
    vdir = version_dir(checkpoint_dir, version)
    with open(os.path.join(vdir, DONE), "w") as f:
        f.write(str(version))
    if keep_max > 0:
        versions = complete_versions(checkpoint_dir)
        for old in versions[:-keep_max]:
            shutil.rmtree(version_dir(checkpoint_dir, old), ignore_errors=True)


def save_single(checkpoint_dir: str, version: int, state: dict[str, Any],
                keep_max: int = 0) -> str:
    """Write a single-writer checkpoint (Local and allreduce strategies).

    A ``data_position`` in ``state`` (Local) is also written torch-free
    (``data_position.json``), so the checkpoint resumes in every mode.
    """
    path = os.path.join(version_dir(checkpoint_dir, version), "model.pt")
    if isinstance(state.get("data_position"), dict):
        data_position.write_position(os.path.dirname(path), state["data_position"])
    save_file(state, path)
    mark_done(checkpoint_dir, version, keep_max)
    logger.info("checkpoint of model version %d saved to %s", version, path)
    return path


def load_single(path: str, map_location: Optional[str] = "cpu") -> dict[str, Any]:
    """Load the single-writer checkpoint at ``path`` (see :func:`resolve`)."""
    vdir = resolve(path)
    staging.ensure(vdir)   # a staged checkpoint: its model.pt comes down first
    file = os.path.join(vdir, "model.pt")
    if not os.path.exists(file):
        raise CheckpointError(f"{vdir} holds no model.pt (a parameter-server checkpoint?)")
    state = torch.load(file, map_location=map_location, weights_only=True)
    if "data_position" not in state and data_position.read_trained(vdir) is not None and \
            os.path.exists(os.path.join(os.path.dirname(vdir), data_position.TABLE)):
        # written by an allreduce group: its position resumes a Local job as well
        state["data_position"] = data_position.read_position(vdir)
    logger.info("loaded checkpoint %s (model version %s)", file, state.get("model_version"))
    return state
