"""Checkpoints in object storage (``--checkpoint_dir=s3://bucket/prefix``), staged on local
disk: the job writes its checkpoints into a local staging directory exactly as into any
checkpoint directory, and a :class:`CheckpointMirror` uploads each version once it is
complete, its ``DONE`` marker last, so a reader of the bucket sees a version only when all of
its files are there (the same atomic-completion rule as on disk). Versions that retention
(``--keep_checkpoint_max``) removes locally are deleted from the bucket after the newer ones
are up.

``--checkpoint_dir_for_init=s3://...`` (a checkpoint directory or one ``version-N`` in it) is
downloaded first: the newest version whose ``DONE`` object exists, with the directory's
task table, into a staging directory the job then resumes from.

The staging directory must be seen by every process that writes checkpoints (a Local job, or
the processes of a ``--cluster=local`` job); on Kubernetes each pod would need its own
uploader, which is not done yet (:func:`check_supported`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
from typing import Optional

from elasticdl.checkpoint.paths import (
    DONE,
    CheckpointError,
    complete_versions,
    delta_notes,
    oldest_needed,
    version_dir,
)
from elasticdl.data import fs
from elasticdl.data.api import DataError

logger = logging.getLogger(__name__)

__all__ = ["CheckpointMirror", "download_checkpoint", "is_remote", "remote_versions",
           "staging_dir"]

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


class CheckpointMirror:
    """Uploads the complete versions of a local checkpoint directory to a URL.

    :meth:`sync` uploads each complete version not uploaded yet (its files, the directory's
    top-level files such as the task table, then ``DONE``) and applies ``keep_max``
    retention to the bucket's complete versions. :meth:`start` runs it every ``interval_s``
    in a thread; :meth:`stop` ends the thread and syncs a last time.
    """

    def __init__(self, local_dir: str, url: str, interval_s: float = 1.0,
                 already: Optional[list[int]] = None, keep_max: int = 0) -> None:
        self.local_dir = local_dir
        self.url = fs.normalize(url)
        self.interval_s = interval_s
        self.keep_max = keep_max
        self.uploaded: set[int] = set()               # by this mirror
        self.already: set[int] = set(already or [])   # complete in the bucket before it
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self.error: Optional[BaseException] = None

    def sync(self) -> list[int]:
        """Upload what is complete and not up yet, then apply retention in the bucket as
        on disk (the newest ``keep_max`` complete versions kept, 0 keeps all); returns the
        versions uploaded now."""
        with self._lock:
            new = [v for v in complete_versions(self.local_dir)
                   if v not in self.uploaded and v not in self.already]
            for v in new:
                if self._upload_version(v):
                    self.uploaded.add(v)
            if self.keep_max > 0:
                ordered = sorted(self.uploaded | self.already)
                # a kept version's PS deltas need the versions back to their whole ones
                kept = [version_dir(self.local_dir, v) for v in ordered[-self.keep_max:]]
                floor = min((oldest_needed(d) for d in kept if os.path.isdir(d)),
                            default=ordered[-1] if ordered else 0)
                for v in [v for v in ordered[:-self.keep_max] if v < floor]:
                    fs.remove(fs.join(self.url, f"version-{v}"))
                    self.uploaded.discard(v)
                    self.already.discard(v)
                    logger.info("checkpoint version %d deleted from %s (retention)", v,
                                fs.redact(self.url))
            return [v for v in new if v in self.uploaded]

    def _upload_version(self, version: int) -> bool:
        vdir = version_dir(self.local_dir, version)
        remote = fs.join(self.url, f"version-{version}")
        try:
            files = []
            for root, _, names in os.walk(vdir):
                files += [os.path.join(root, n) for n in names if n != DONE]
            for path in sorted(files):
                rel = os.path.relpath(path, vdir).replace(os.sep, "/")
                fs.upload(path, fs.join(remote, rel))
            for name in sorted(os.listdir(self.local_dir)):
                path = os.path.join(self.local_dir, name)
                if os.path.isfile(path) and not name.endswith(".tmp"):
                    fs.upload(path, fs.join(self.url, name))
            fs.upload(os.path.join(vdir, DONE), fs.join(remote, DONE))   # last
        except (FileNotFoundError, DataError):
            if os.path.exists(os.path.join(vdir, DONE)):
                raise
            # retention removed it while we uploaded: a newer version is complete
            logger.info("checkpoint version %d removed before its upload finished", version)
            return False
        logger.info("checkpoint version %d uploaded to %s", version, fs.redact(remote))
        return True

    def start(self) -> CheckpointMirror:
        self._thread = threading.Thread(target=self._run, name="checkpoint-mirror",
                                        daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sync()
            except Exception as e:  # noqa: BLE001 - kept and raised by stop(); retried here
                self.error = e
                logger.warning("checkpoint upload to %s failed (%s); retrying",
                               fs.redact(self.url), e)
            else:
                self.error = None

    def stop(self) -> list[int]:
        """Stop the thread and sync a last time; returns the versions uploaded.

        Raises:
            DataError: the last sync failed (names the URL).
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sync()
        return sorted(self.uploaded)
