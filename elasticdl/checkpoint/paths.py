"""Checkpoint directory layout, without torch (the master uses it too).

``<dir>/version-<N>/`` holds one checkpoint; it is complete once its ``DONE``
marker exists.
"""

from __future__ import annotations

import json
import os
import re

_VERSION_DIR = re.compile(r"^version-(\d+)$")
DONE = "DONE"
DELTA_NOTE = ".delta.json"   # beside a delta shard: ps-<i>-of-<n>.delta.json


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


DIVERGED_PREFIX = "diverged-"


def set_aside(checkpoint_dir: str, above: int, below: int | None = None) -> list[int]:
    """Rename the complete versions in ``(above, below)`` to ``diverged-version-N`` (kept
    for a post-mortem, invisible to every reader of versions): the checkpoints a
    diverged model wrote, once the job rolled back to ``above``. Idempotent. Returns
    the versions set aside."""
    moved = []
    for v in complete_versions(checkpoint_dir):
        if v > above and (below is None or v < below):
            src = version_dir(checkpoint_dir, v)
            dst = base = os.path.join(checkpoint_dir, DIVERGED_PREFIX + os.path.basename(src))
            n = 0
            while os.path.exists(dst):
                n += 1
                dst = f"{base}.{n}"
            os.rename(src, dst)
            moved.append(v)
    return moved


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


def version_of(version_path: str) -> int:
    """The model version of a ``version-N`` directory."""
    m = _VERSION_DIR.match(os.path.basename(os.path.normpath(version_path)))
    if not m:
        raise CheckpointError(f"{version_path!r} is not a version-N checkpoint directory")
    return int(m.group(1))


def check_fresh_checkpoint_dir(checkpoint_dir: str, checkpoint_dir_for_init: str) -> None:
    """A new training run may write into ``checkpoint_dir`` only if it holds no
    complete checkpoint, or the run resumes from one there
    (``--checkpoint_dir_for_init`` inside it). Otherwise a relaunched PS, which
    restores the newest checkpoint of its own directory, would take an earlier
    job's model as this job's.

    Raises:
        CheckpointError: naming both flags.
    """
    if not checkpoint_dir:
        return
    versions = complete_versions(checkpoint_dir)
    if not versions:
        return
    if checkpoint_dir_for_init:
        init_dir = os.path.dirname(os.path.abspath(resolve(checkpoint_dir_for_init)))
        if init_dir == os.path.abspath(checkpoint_dir):
            return
    raise CheckpointError(
        f"--checkpoint_dir {checkpoint_dir} already holds checkpoints of an earlier run "
        f"(version-{versions[-1]}); to continue it pass "
        f"--checkpoint_dir_for_init={checkpoint_dir}, otherwise use an empty directory")


def delta_notes(version_path: str) -> dict[str, dict[str, int]]:
    """The delta shards of a PS checkpoint version: ``{shard file: {"prev_version",
    "full_version"}}`` from the notes written beside them (a whole shard has none)."""
    out = {}
    for name in sorted(os.listdir(version_path)):
        if name.endswith(DELTA_NOTE):
            with open(os.path.join(version_path, name), encoding="utf-8") as f:
                out[name[:-len(DELTA_NOTE)] + ".pt"] = {k: int(v) for k, v in
                                                        json.load(f).items()}
    return out


def oldest_needed(version_path: str) -> int:
    """The oldest version a PS checkpoint version needs to be read whole (the whole
    checkpoint its deltas start from; its own version when it has no delta)."""
    return min([version_of(version_path)] +
               [n["full_version"] for n in delta_notes(version_path).values()])
