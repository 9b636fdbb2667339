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
import re
import shutil
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

_VERSION_DIR = re.compile(r"^version-(\d+)$")
DONE = "DONE"


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for."""


def version_dir(checkpoint_dir: str, version: int) -> str:
    return os.path.join(checkpoint_dir, f"version-{version}")


def complete_versions(checkpoint_dir: str) -> list[int]:
    """Versions with a DONE marker, oldest first."""
    if not os.path.isdir(checkpoint_dir):
        return []
    out = []
    for name in os.listdir(checkpoint_dir):
        m = _VERSION_DIR.match(name)
        if m and os.path.exists(os.path.join(checkpoint_dir, name, DONE)):
            out.append(int(m.group(1)))
    return sorted(out)


def save_file(state: Any, path: str) -> None:
    """``torch.save`` to a temp file then rename: readers see old or new, never half."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    torch.save(state, tmp)
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
    """Write a single-writer checkpoint (Local and allreduce strategies)."""
    path = os.path.join(version_dir(checkpoint_dir, version), "model.pt")
    save_file(state, path)
    mark_done(checkpoint_dir, version, keep_max)
    logger.info("checkpoint of model version %d saved to %s", version, path)
    return path


def resolve(path: str) -> str:
    """A ``version-N`` directory for ``path``: itself, or the newest complete
    version inside a checkpoint directory.

    Raises:
        CheckpointError: nothing complete is there.
    """
    if os.path.isfile(path):
        return os.path.dirname(path)
    if _VERSION_DIR.match(os.path.basename(os.path.normpath(path))):
        if not os.path.exists(os.path.join(path, DONE)):
            raise CheckpointError(f"checkpoint {path} is incomplete (no {DONE} marker)")
        return path
    versions = complete_versions(path)
    if not versions:
        raise CheckpointError(f"no complete checkpoint under {path!r}")
    return version_dir(path, versions[-1])


def load_single(path: str, map_location: Optional[str] = "cpu") -> dict[str, Any]:
    """Load the single-writer checkpoint at ``path`` (see :func:`resolve`)."""
    vdir = resolve(path)
    file = os.path.join(vdir, "model.pt")
    if not os.path.exists(file):
        raise CheckpointError(f"{vdir} holds no model.pt (a parameter-server checkpoint?)")
    state = torch.load(file, map_location=map_location, weights_only=True)
    logger.info("loaded checkpoint %s (model version %s)", file, state.get("model_version"))
    return state
