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
from collections.abc import Callable
from typing import Optional

from elasticdl.checkpoint.paths import (
    DONE,
    CheckpointError,
    delta_notes,
    version_dir,
)
from elasticdl.data import fs

logger = logging.getLogger(__name__)

__all__ = ["download_chain", "download_checkpoint", "download_tree", "is_remote", "named_version",
           "remote_versions", "staging_dir"]

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


def named_version(url: str) -> tuple[str, int, bool]:
    """What a checkpoint URL names: ``(base, version, named)``, the directory holding its
    versions, the version (the one named by a ``version-N`` URL, else the newest
    complete one) and whether the URL named it.

    Raises:
        CheckpointError: the named version has no ``DONE``, or no version is complete.
        DataError: the store cannot be read (names the URL).
    """
    url = fs.normalize(url)
    parent, _, last = url.rpartition("/")
    m = _VERSION.match(last)
    if m:
        if not fs.exists(fs.join(url, DONE)):
            raise CheckpointError(f"checkpoint {fs.redact(url)} is incomplete (no {DONE} "
                                  "marker)")
        return parent, int(m.group(1)), True
    versions = remote_versions(url)
    if not versions:
        raise CheckpointError(f"no complete checkpoint under {fs.redact(url)!r}")
    return url, versions[-1], False


def download_tree(url: str, local: str, skip: Callable[[str], bool] = lambda name: False,
                  on_file: Optional[Callable[[str, str], None]] = None) -> None:
    """The files under ``url`` missing in ``local`` (those whose name ``skip`` accepts left
    out), ``DONE`` last, as it was written; ``on_file(relative path, local path)`` for
    each file wanted, present before or not."""
    todo = [("", url)]
    while todo:
        sub, at = todo.pop()
        for name, is_dir in fs.list_entries(at):
            rel = f"{sub}{name}"
            if is_dir:
                todo.append((f"{rel}/", fs.join(at, name)))
            elif name != DONE and not skip(name):
                path = os.path.join(local, *rel.split("/"))
                if not os.path.exists(path):
                    fs.download(fs.join(at, name), path)
                if on_file is not None:
                    on_file(rel, path)
    done = os.path.join(local, DONE)
    if not os.path.exists(done) and fs.exists(fs.join(url, DONE)):
        fs.download(fs.join(url, DONE), done)


def download_chain(base: str, local_dir: str, version: int, shard: str = "",
                   fetch: Optional[Callable[[int], None]] = None) -> None:
    """Version ``version`` of ``base`` and the versions its PS delta shards are folded
    onto, back to their whole ones (:mod:`elasticdl.checkpoint.ps_shards`), into
    ``local_dir``; ``shard`` (``ps-<i>-of-<n>.pt``): that shard's chain only.
    ``fetch(version)`` brings one version (default: all its files)."""
    def whole(v: int) -> None:
        download_tree(fs.join(base, f"version-{v}"), version_dir(local_dir, v))

    get = fetch or whole
    todo, seen = [version], set()
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        get(v)
        for name, note in delta_notes(version_dir(local_dir, v)).items():
            if not shard or name == shard:
                todo.append(int(note["prev_version"]))


def download_checkpoint(url: str, local_dir: str) -> str:
    """Download the checkpoint ``url`` names into ``local_dir``; returns the local path to
    give where the URL was (the directory, or the ``version-N`` directory).

    Raises:
        CheckpointError: nothing complete there.
        DataError: the store cannot be read (names the URL).
    """
    base, version, named = named_version(url)
    for name, is_dir in fs.list_entries(base):      # the task table and other top files
        if not is_dir:
            fs.download(fs.join(base, name), os.path.join(local_dir, name))
    download_chain(base, local_dir, version)
    logger.info("checkpoint version %d downloaded from %s to %s", version, fs.redact(base),
                local_dir)
    return version_dir(local_dir, version) if named else local_dir
