"""Checkpoint URLs (``--checkpoint_dir=s3://...``, ``--checkpoint_dir_for_init=s3://...``)
staged on local disk, for a whole job whose processes share a disk (the ``elasticdl``
process of a Local or ``--cluster=local`` job) or for one pod of a Kubernetes job.

:func:`stage` gives a job spec local directories in place of the URLs: the checkpoint to
resume from is downloaded first, and a :class:`~elasticdl.checkpoint.mirror.CheckpointMirror`
keeps the local checkpoint directory and the URL in step while the job runs. In a pod
(:func:`stage_pod`) only the small files of the newest complete version come down at the
start (``DONE``, data positions, delta notes); a restore brings the shards it reads
(:func:`ensure`: a PS restoring under the same layout only its own). Paths that travel
between pods (a rollback's version directory) travel as URLs: :func:`to_url` on the sender,
:func:`to_local` on the receiver; a child process gets the URLs back (:func:`for_children`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
from typing import Any, Optional

from elasticdl.checkpoint import remote
from elasticdl.checkpoint.mirror import CheckpointMirror
from elasticdl.checkpoint.paths import CheckpointError, version_dir
from elasticdl.common.job_dirs import elasticdl_home
from elasticdl.data import fs
from elasticdl.data.api import DataError

logger = logging.getLogger(__name__)

__all__ = ["ensure", "flush", "for_children", "refuse_earlier_run", "stage", "stage_pod",
           "stop_all", "to_local", "to_url"]

_VERSION = re.compile(r"^version-(\d+)$")
_lock = threading.Lock()
_MIRRORS: dict[str, CheckpointMirror] = {}   # local checkpoint directory -> its mirror
_STAGED: dict[str, str] = {}                 # local directory -> the URL it stands for


def _inside(init_url: str, ckpt_url: str) -> bool:
    init, ckpt = fs.normalize(init_url), fs.normalize(ckpt_url)
    return init == ckpt or init.rpartition("/")[0] == ckpt


def refuse_earlier_run(spec: Any) -> list[int]:
    """The complete versions under a ``--checkpoint_dir`` URL; refused when there are any
    and the job does not resume from that directory.

    Raises:
        CheckpointError: naming both flags.
        DataError: the store cannot be read (names the URL).
    """
    ckpt, init = spec.checkpoint_dir, spec.checkpoint_dir_for_init
    already = remote.remote_versions(ckpt)
    if already and not (init and _inside(init, ckpt)):
        raise CheckpointError(
            f"--checkpoint_dir {fs.redact(ckpt)} already holds complete checkpoints "
            f"(versions {already[:5]}); resume from it with --checkpoint_dir_for_init="
            f"{fs.redact(ckpt)} or pick a new prefix")
    return already


def stage(spec: Any, root: str, pod: bool = False, observe: bool = False) -> Any:
    """``spec`` with local directories under ``root`` in place of checkpoint URLs (the
    mirror started); ``spec`` itself when it names none. ``pod``: one process of a job
    whose processes share no disk (small files first, shards on demand, local copies
    pruned; no check against an earlier run, which the client made); ``observe``: the
    versions others complete come down (the master's readers).

    Raises:
        CheckpointError: nothing complete to resume from, or (not ``pod``) the
            ``--checkpoint_dir`` URL holding an earlier run's checkpoints.
        DataError: the store cannot be read or written (names the URL).
    """
    ckpt, init = spec.checkpoint_dir, spec.checkpoint_dir_for_init
    if not (remote.is_remote(ckpt) or remote.is_remote(init)):
        return spec
    fs.configure_from_spec(spec)    # --data_endpoint serves checkpoints too
    changes: dict[str, Any] = {}
    mirror = None
    if remote.is_remote(ckpt):
        local = changes["checkpoint_dir"] = remote.staging_dir(root, ckpt, "checkpoints")
        already = remote.remote_versions(ckpt) if pod else refuse_earlier_run(spec)
        mirror = CheckpointMirror(local, ckpt, already=already, keep_max=spec.keep_checkpoint_max,
                                  observe=observe, prune_local=pod)
        _register(local, ckpt, mirror)
        if pod and already:        # what a relaunched pod's readers look at first
            mirror.fetch_small(already[-1])
    if remote.is_remote(init):
        changes["checkpoint_dir_for_init"] = _stage_init(spec, init, root, changes, pod)
    if mirror is not None:
        mirror.adopt()
        logger.info("checkpoints staged in %s and kept in step with %s",
                    changes["checkpoint_dir"], fs.redact(ckpt))
        mirror.start()
    return dataclasses.replace(spec, **changes)


def _stage_init(spec: Any, init: str, root: str, changes: dict[str, Any], pod: bool) -> str:
    """The local place of ``--checkpoint_dir_for_init``: inside the staged checkpoint
    directory when it names it (or one of its versions), else its own staging directory
    (in a pod behind a mirror that only fetches: the shards come when restored)."""
    norm = fs.normalize(init)
    base_url, version, named = remote.named_version(norm)
    if remote.is_remote(spec.checkpoint_dir) and _inside(init, spec.checkpoint_dir):
        local = changes["checkpoint_dir"]
        mirror: Optional[CheckpointMirror] = _MIRRORS[os.path.abspath(local)]
    else:
        local = remote.staging_dir(root, base_url, "init")
        mirror = CheckpointMirror(local, base_url) if pod else None   # never started
        if mirror is not None:
            _register(local, base_url, mirror)
        else:
            with _lock:
                _STAGED[os.path.abspath(local)] = base_url
    if pod and mirror is not None:
        mirror.fetch_small(version)
    else:
        remote.download_checkpoint(norm, local)
    return version_dir(local, version) if named else local


def stage_pod(spec: Any, role: str) -> Any:
    """:func:`stage` for one pod of a Kubernetes job (``role``: ``master``, ``ps-0``,
    ``worker-3``...): its own staging directory, as the pods share no disk."""
    if spec.cluster != "k8s":
        return spec
    root = os.path.join(elasticdl_home(), "checkpoint-staging", spec.job_name, role)
    return stage(spec, root, pod=True, observe=role == "master")


def _register(local: str, url: str, mirror: CheckpointMirror) -> None:
    with _lock:
        _MIRRORS[os.path.abspath(local)] = mirror
        _STAGED[os.path.abspath(local)] = fs.normalize(url)


def _owner(path: str) -> Optional[tuple[str, str]]:
    """``(local staged directory, URL)`` that ``path`` lies in."""
    path = os.path.abspath(path)
    with _lock:
        for local, url in _STAGED.items():
            if path == local or path.startswith(local + os.sep):
                return local, url
    return None


def to_url(path: str) -> str:
    """A staged local path as the URL it stands for (other paths unchanged)."""
    if not path or fs.is_url(path):
        return path
    owner = _owner(path)
    if owner is None:
        return path
    local, url = owner
    rest = os.path.relpath(os.path.abspath(path), local).replace(os.sep, "/")
    return url if rest == "." else fs.join(url, rest)


def to_local(path: str) -> str:
    """A URL under a staged URL as this process's local path (its files brought by
    :func:`ensure` when read); other paths unchanged."""
    if not path or not fs.is_url(path):
        return path
    norm = fs.normalize(path)
    with _lock:
        staged = list(_STAGED.items())
    for local, url in staged:
        if norm == url or norm.startswith(url + "/"):
            rest = norm[len(url):].lstrip("/")
            return os.path.join(local, *rest.split("/")) if rest else local
    raise CheckpointError(f"{fs.redact(path)} is not under this job's checkpoint URLs")


def ensure(vdir: str, shard: str = "") -> Optional[int]:
    """Bring the files of the staged version directory ``vdir`` that a restore reads:
    every shard, or only ``shard`` (``ps-<i>-of-<n>.pt``) when the version has ``n`` shards.
    Returns the version's number of PS shards (0: a single-writer checkpoint); ``None``
    when ``vdir`` is not staged (a local directory: nothing to do)."""
    owner = _owner(vdir)
    if owner is None or not _VERSION.match(os.path.basename(os.path.normpath(vdir))):
        return None
    local = os.path.dirname(os.path.abspath(vdir))
    with _lock:
        mirror = _MIRRORS.get(local)
    if mirror is None:      # an init checkpoint: downloaded whole when staged
        return None
    version = int(os.path.basename(os.path.normpath(vdir)).split("-")[1])
    names = [n for n, is_dir in fs.list_entries(fs.join(mirror.url, f"version-{version}"))
             if not is_dir and n.startswith("ps-") and n.endswith(".pt")]
    n = int(names[0].rsplit("-", 1)[1][:-3]) if names else 0
    mirror.fetch(version, shard=shard if shard and shard.endswith(f"-of-{n}.pt") else "")
    return n


def flush(local_dir: str, quiet: bool = False) -> None:
    """Sync the mirror of ``local_dir`` now (a final checkpoint up before answering);
    nothing for a directory that is not staged.

    Raises:
        DataError: the store cannot be written (names the URL); with ``quiet`` logged
            instead (the mirror's thread tries again).
    """
    with _lock:
        mirror = _MIRRORS.get(os.path.abspath(local_dir)) if local_dir else None
    if mirror is None:
        return
    try:
        mirror.sync()
    except DataError as e:
        if not quiet:
            raise
        logger.warning("checkpoint sync to %s failed (%s); the mirror retries",
                       fs.redact(mirror.url), e)


def for_children(spec: Any) -> Any:
    """``spec`` with its staged directories given back as URLs (what a child pod gets)."""
    urls = {f: to_url(getattr(spec, f)) for f in ("checkpoint_dir", "checkpoint_dir_for_init")}
    changes = {f: url for f, url in urls.items() if url != getattr(spec, f)}
    return dataclasses.replace(spec, **changes) if changes else spec


def stop_all(quiet: bool = False) -> list[int]:
    """Stop every mirror of this process after a last sync; returns the versions they
    completed in the bucket.

    Raises:
        DataError: a last sync failed (names the URL); with ``quiet`` logged instead (a
            pod's exit: what was not up stays in its staging directory).
    """
    with _lock:
        mirrors = list(_MIRRORS.values())
        _MIRRORS.clear()
        _STAGED.clear()
    done: list[int] = []
    for mirror in mirrors:
        try:
            done += mirror.stop()
        except DataError as e:
            if not quiet:
                raise
            logger.error("the last checkpoint sync to %s failed (%s): what was written "
                         "since the last one stays in %s", fs.redact(mirror.url), e,
                         mirror.local_dir)
    return sorted(done)
