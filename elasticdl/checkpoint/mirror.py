"""A local checkpoint directory kept in step with a checkpoint URL (object storage).

The writers of a job write their checkpoints into a local directory as into any checkpoint
directory; a :class:`CheckpointMirror` per process (or one for a job whose processes share
a disk) uploads what they write and applies the completion rule in the bucket:

* every file is uploaded once written (again if rewritten), a version's companions (data
  positions, delta notes) before its ``.pt`` files; ``*.tmp``/``*.part`` never;
* a version becomes complete in the bucket when its ``DONE`` object is written, last:
  by the mirror that saw it complete locally (a single writer: Local, allreduce; or every
  PS shard on a shared disk), or, where each PS has its own disk (Kubernetes), by the PS
  mirror that, after uploading its own shard, finds all ``n`` shards of the version in the
  bucket (whichever PS is last; writing it twice is harmless). A reader of the bucket takes
  only versions whose ``DONE`` exists (:func:`elasticdl.checkpoint.remote.remote_versions`);
* retention (``keep_max``) is applied in the bucket by whoever completed a version, keeping
  what a kept delta is folded onto (its delta notes read from the bucket);
* ``observe``: the versions others complete come down as their small files (``DONE``, data
  positions, delta notes; no ``.pt``), so a master's readers see them as on a shared disk;
  :meth:`fetch` brings a version's shards when something restores it;
* ``prune_local``: the local copies of versions below what this process still needs (its
  own delta chain) are deleted once a newer version is complete: the staging directory of
  a pod holds O(``full_checkpoint_every``) versions, not the job's history.

Bookkeeping: one ``(size, mtime)`` per local file (bounded by the pruning), one integer per
bucket version this process knows complete (bounded by retention; with
``--keep_checkpoint_max=0`` it grows by one per checkpoint: 8 bytes each, 1e7 checkpoints are
not a job).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
from typing import NamedTuple, Optional

from elasticdl.checkpoint import remote
from elasticdl.checkpoint.paths import DELTA_NOTE, DONE, oldest_needed, version_dir
from elasticdl.data import fs
from elasticdl.data.api import DataError

logger = logging.getLogger(__name__)

__all__ = ["CheckpointMirror"]

_VERSION = re.compile(r"^version-(\d+)$")
_SHARD = re.compile(r"^ps-(\d+)-of-(\d+)\.pt$")


class _File(NamedTuple):
    rel: str                 # relative to the checkpoint directory, "/"-separated
    path: str
    key: tuple[int, int]     # (size, mtime_ns): rewritten files go up again


def _files(base: str, sub: str = "") -> list[_File]:
    top = os.path.join(base, sub) if sub else base
    out = []
    for root, dirs, names in os.walk(top):
        if not sub:
            dirs[:] = []       # the top level only: versions are pushed one by one
        for name in names:
            if name == DONE or name.endswith(".part") or ".tmp" in name:
                continue
            path = os.path.join(root, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:      # removed meanwhile (retention)
                continue
            rel = os.path.relpath(path, base).replace(os.sep, "/")
            out.append(_File(rel, path, (st.st_size, st.st_mtime_ns)))
    return out


class CheckpointMirror:
    """Keeps ``local_dir`` and the checkpoint URL ``url`` in step (module docstring).

    :meth:`sync` does one round and returns the versions it completed in the bucket;
    :meth:`start` runs it every ``interval_s`` in a thread; :meth:`stop` ends the thread and
    syncs a last time. ``already``: the versions complete in the bucket at the start.
    """

    def __init__(self, local_dir: str, url: str, interval_s: float = 1.0,
                 already: Optional[list[int]] = None, keep_max: int = 0,
                 observe: bool = False, prune_local: bool = False) -> None:
        self.local_dir = local_dir
        self.url = fs.normalize(url)
        self.interval_s = interval_s
        self.keep_max = keep_max
        self.observe = observe
        self.prune_local = prune_local
        self.uploaded: set[int] = set()      # versions this mirror completed
        self.complete: set[int] = set(already or [])   # complete in the bucket, as known
        self.pulled: set[int] = set()        # observed: their small files came down
        self._sent: dict[str, tuple[int, int]] = {}
        self._floors: dict[int, int] = {}    # version -> oldest version it needs
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.RLock()
        self.error: Optional[BaseException] = None

    # ------------------------------------------------------------------ rounds
    def adopt(self) -> None:
        """Take every file now in the local directory as being in the bucket already
        (it was just downloaded from there)."""
        with self._lock:
            for sub in [""] + [n for n in os.listdir(self.local_dir) if _VERSION.match(n)]:
                for f in _files(self.local_dir, sub):
                    self._sent[f.rel] = f.key

    def sync(self) -> list[int]:
        """One round: upload what changed, complete what can be, observe, retain, prune;
        returns the versions completed in the bucket by this round."""
        with self._lock:
            self._push_top()
            new = [v for v in self._local_versions()
                   if v not in self.complete and self._push_version(v)]
            if self.observe:
                self._pull()
            if new and self.keep_max > 0:
                self._retain()
            if self.prune_local:
                self._prune()
            return new

    def _local_versions(self) -> list[int]:
        if not os.path.isdir(self.local_dir):
            return []
        return sorted(int(m.group(1)) for m in map(_VERSION.match, os.listdir(self.local_dir))
                      if m)

    def _upload(self, f: _File) -> None:
        if self._sent.get(f.rel) != f.key:
            fs.upload(f.path, fs.join(self.url, f.rel))
            self._sent[f.rel] = f.key

    def _push_top(self) -> None:
        """The directory's own files (the task table, the job history)."""
        for f in _files(self.local_dir):
            self._upload(f)

    def _push_version(self, version: int) -> bool:
        vdir = version_dir(self.local_dir, version)
        remote_v = fs.join(self.url, f"version-{version}")
        try:
            files = _files(self.local_dir, f"version-{version}")
            for f in sorted(files, key=lambda f: (f.rel.endswith(".pt"), f.rel)):
                self._upload(f)
            if os.path.exists(os.path.join(vdir, DONE)):
                self._push_top()    # the task table the version's data position names
                fs.upload(os.path.join(vdir, DONE), fs.join(remote_v, DONE))   # last
            elif not self._complete_in_bucket(version, vdir, remote_v):
                return False
        except (FileNotFoundError, DataError):
            if os.path.exists(os.path.join(vdir, DONE)):
                raise
            # retention removed it while we uploaded: a newer version is complete
            logger.info("checkpoint version %d removed before its upload finished", version)
            return False
        self.complete.add(version)
        self.uploaded.add(version)
        logger.info("checkpoint version %d complete in %s", version, fs.redact(remote_v))
        return True

    def _complete_in_bucket(self, version: int, vdir: str, remote_v: str) -> bool:
        """A PS shard of ``version`` is up: write ``DONE`` if every shard is there (the
        last PS to upload does it), or note that another PS did."""
        try:
            mine = [m for m in map(_SHARD.match, os.listdir(vdir)) if m]
        except FileNotFoundError:
            return False
        if not mine:
            return False
        n = int(mine[0].group(2))
        there = {name for name, is_dir in fs.list_entries(remote_v) if not is_dir}
        if DONE in there:
            return True
        if not all(f"ps-{i}-of-{n}.pt" in there for i in range(n)):
            return False
        fs.write_bytes(fs.join(remote_v, DONE), str(version).encode())
        return True

    # ------------------------------------------------------------------ observing
    def _pull(self) -> None:
        """The versions others completed: their small files, ``DONE`` last; pulled versions
        the bucket no longer holds (retention) go locally too."""
        listed = {int(m.group(1)) for name, is_dir in fs.list_entries(self.url)
                  if is_dir and (m := _VERSION.match(name))}
        newest = max(self.complete, default=-1)
        for v in sorted(listed - self.complete):
            # an incomplete version below the newest complete one is abandoned (a PS lost
            # before writing it): not asked about again
            if v < newest or not fs.exists(fs.join(fs.join(self.url, f"version-{v}"), DONE)):
                continue
            self.complete.add(v)
            vdir = version_dir(self.local_dir, v)
            if not os.path.exists(os.path.join(vdir, DONE)):
                self._download(v, small_only=True)
                self.pulled.add(v)
        for v in sorted(self.pulled - listed):
            shutil.rmtree(version_dir(self.local_dir, v), ignore_errors=True)
            self._forget(v)
        for v in self.complete - listed:   # gone by retention: what is known stays bounded
            self._forget(v)

    def _download(self, version: int, small_only: bool, shard: str = "") -> None:
        """The files of bucket ``version`` missing locally (``.pt`` too unless
        ``small_only``; with ``shard`` only that ``.pt``), ``DONE`` last."""
        def skip(name: str) -> bool:
            return name.endswith(".pt") and (small_only or bool(shard and name != shard))

        def sent(rel: str, path: str) -> None:   # in step with the bucket: not uploaded
            st = os.stat(path)
            self._sent[f"version-{version}/{rel}"] = (st.st_size, st.st_mtime_ns)

        remote.download_tree(fs.join(self.url, f"version-{version}"),
                             version_dir(self.local_dir, version), skip, sent)

    def fetch_small(self, version: int) -> None:
        """The small files of bucket ``version`` (``DONE``, data positions, delta notes)
        and the directory's own files (task table, job history), as a relaunched pod's
        readers want them before anything else."""
        with self._lock:
            for name, is_dir in fs.list_entries(self.url):
                local = os.path.join(self.local_dir, name)
                if not is_dir and not os.path.exists(local):
                    fs.download(fs.join(self.url, name), local)
            self._download(version, small_only=True)
            self.pulled.add(version)
            self.complete.add(version)

    def fetch(self, version: int, shard: str = "") -> str:
        """Bring bucket ``version`` whole (its shards, and the versions its deltas are
        folded onto) into the local directory; returns its local path. ``shard``
        (``ps-<i>-of-<n>.pt``): that shard's files only (a PS restoring its own).

        Raises:
            DataError: the store cannot be read (names the URL).
        """
        with self._lock:
            def one(v: int) -> None:
                self._download(v, small_only=False, shard=shard)
                self.pulled.add(v)
                self.complete.add(v)

            remote.download_chain(self.url, self.local_dir, version, shard, fetch=one)
            return version_dir(self.local_dir, version)

    # ------------------------------------------------------------------ retention
    def _floor(self, version: int) -> int:
        """The oldest version bucket ``version`` needs (its delta notes, read there)."""
        if version not in self._floors:
            remote_v = fs.join(self.url, f"version-{version}")
            floor = version
            for name, is_dir in fs.list_entries(remote_v):
                if not is_dir and name.endswith(DELTA_NOTE):
                    note = json.loads(fs.read_bytes(fs.join(remote_v, name)))
                    floor = min(floor, int(note["full_version"]))
            self._floors[version] = floor
        return self._floors[version]

    def _retain(self) -> None:
        """The newest ``keep_max`` complete versions in the bucket (whoever completed them:
        another worker may have written some) and what their deltas need are kept; every
        older version goes, complete or abandoned (a version some PS never wrote)."""
        listed = {int(m.group(1)) for name, is_dir in fs.list_entries(self.url)
                  if is_dir and (m := _VERSION.match(name))}
        for v in sorted(listed - self.complete):
            if fs.exists(fs.join(fs.join(self.url, f"version-{v}"), DONE)):
                self.complete.add(v)
        for v in self.complete - listed:    # deleted by another process's retention
            self._forget(v)
        kept = sorted(self.complete)[-self.keep_max:]
        if not kept:
            return
        floor = min(self._floor(v) for v in kept)
        for v in sorted(v for v in listed if v < floor):
            fs.remove(fs.join(self.url, f"version-{v}"))
            self._forget(v)
            logger.info("checkpoint version %d deleted from %s (retention)", v,
                        fs.redact(self.url))

    def _forget(self, version: int) -> None:
        self.complete.discard(version)
        self.uploaded.discard(version)
        self.pulled.discard(version)
        self._floors.pop(version, None)
        prefix = f"version-{version}/"
        for rel in [r for r in self._sent if r.startswith(prefix)]:
            del self._sent[rel]

    def _prune(self) -> None:
        """Local versions below this process's own needs, once a newer one is complete."""
        local = self._local_versions()
        if not local or not self.complete:
            return
        newest_done = max(self.complete)
        # what a version being written needs too (its delta note may not be there yet)
        try:
            need = min(oldest_needed(version_dir(self.local_dir, v))
                       for v in [v for v in local if v >= newest_done] or local[-1:])
        except FileNotFoundError:    # a version removed meanwhile: next round
            return
        for v in local:
            if v < need and v < newest_done:
                shutil.rmtree(version_dir(self.local_dir, v), ignore_errors=True)
                prefix = f"version-{v}/"
                for rel in [r for r in self._sent if r.startswith(prefix)]:
                    del self._sent[rel]
                self.pulled.discard(v)

    # ------------------------------------------------------------------ thread
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
        """Stop the thread and sync a last time; returns the versions completed by this
        mirror (still in the bucket).

        Raises:
            DataError: the last sync failed (names the URL).
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sync()
        return sorted(self.uploaded)

