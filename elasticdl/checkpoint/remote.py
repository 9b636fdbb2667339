"""Checkpoints in object storage (``--checkpoint_dir=s3://bucket/prefix``): what is in the
bucket and how it comes down. A version there is complete once its ``DONE`` object exists
(the atomic-completion rule of a local directory); :func:`remote_versions` lists those,
:func:`download_checkpoint` brings the newest (or a named one) with the versions its PS
deltas are folded onto and the directory's task table. Writing goes through a local
staging directory and :mod:`elasticdl.checkpoint.mirror`; :mod:`elasticdl.checkpoint.staging`
wires both into a job.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil

from elasticdl.checkpoint.paths import (
    DONE,
    CheckpointError,
    delta_notes,
    version_dir,
)
from elasticdl.data import fs

logger = logging.getLogger(__name__)

__all__ = ["download_checkpoint", "is_remote", "remote_versions", "staging_dir"]

_VERSION = re.compile(r"^version-(\d+)$")


def is_remote(path: str) -> bool:
    """Whether a checkpoint flag names object storage."""
    return bool(path) and fs.is_url(path)


def staging_dir(root: str, url: str, purpose: str) -> str:
    """A fresh local directory for ``url`` under ``root`` (emptied if it exists)."""
    key = hashlib.sha1(url.encode()).hexdigest()[:12]
    path = os.path.join(root, f"{purpose}-{key}")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def remote_versions(url: str) -> list[int]:
    """Versions under a checkpoint URL whose ``DONE`` object exists, oldest first."""
    out = []
    for name, is_dir in fs.list_entries(url):
        m = _VERSION.match(name)
        if m and is_dir and fs.exists(fs.join(fs.join(url, name), DONE)):
            out.append(int(m.group(1)))
    return sorted(out)


def _download_tree(url: str, local: str) -> None:
    for name, is_dir in fs.list_entries(url):
        if is_dir:
            _download_tree(fs.join(url, name), os.path.join(local, name))
        elif name != DONE:
            fs.download(fs.join(url, name), os.path.join(local, name))
    if fs.exists(fs.join(url, DONE)):   # the marker last, as it was written
        fs.download(fs.join(url, DONE), os.path.join(local, DONE))


def _download_chain(base: str, local_dir: str, version: int) -> None:
    """The versions the PS delta shards of ``version`` are folded onto, back to their
    whole ones (:mod:`elasticdl.checkpoint.ps_shards`)."""
    todo = [version]
    while todo:
        vdir = version_dir(local_dir, todo.pop())
        for shard, note in delta_notes(vdir).items():
            prev = version_dir(local_dir, note["prev_version"])
            if not os.path.exists(os.path.join(prev, shard)):
                _download_tree(fs.join(base, f"version-{note['prev_version']}"), prev)
                todo.append(note["prev_version"])


def download_checkpoint(url: str, local_dir: str) -> str:
    """Download the checkpoint ``url`` names into ``local_dir``; returns the local path to
    give where the URL was (the directory, or the ``version-N`` directory).

    Raises:
        CheckpointError: nothing complete there.
        DataError: the store cannot be read (names the URL).
    """
    url = fs.normalize(url)
    parent, _, last = url.rpartition("/")
    m = _VERSION.match(last)
    if m:
        if not fs.exists(fs.join(url, DONE)):
            raise CheckpointError(f"checkpoint {url} is incomplete (no {DONE} marker)")
        base, versions = parent, [int(m.group(1))]
    else:
        base, versions = url, remote_versions(url)
        if not versions:
            raise CheckpointError(f"no complete checkpoint under {url!r}")
    version = versions[-1]
    for name, is_dir in fs.list_entries(base):      # the task table and other top files
        if not is_dir:
            fs.download(fs.join(base, name), os.path.join(local_dir, name))
    _download_tree(fs.join(base, f"version-{version}"), version_dir(local_dir, version))
    _download_chain(base, local_dir, version)
    logger.info("checkpoint version %d downloaded from %s to %s", version, fs.redact(base),
                local_dir)
    return version_dir(local_dir, version) if m else local_dir


