"""Where a PS restores from: one rule, the master's (it knows the job's
checkpoints, the init checkpoint and the version asked for), passed to the PS
as ``--restore_from`` and in rollback requests; the PS never guesses. It lives with the
checkpoints because both apply it: the master chooses, the PS checks a rollback's directory.

* A run's first launch restores the init checkpoint (``--checkpoint_dir_for_init``:
  a checkpoint directory means its newest complete version, a ``version-N``
  directory means exactly N), or nothing.
* A rollback restores the newest complete checkpoint *this run* wrote (a version
  above the run's base, see :func:`run_base`), else the init checkpoint (a PS
  that dies before the resumed run wrote its own checkpoint rolls every PS back
  to where the run started and the whole run's work is re-queued), else there
  is none (the PS starts empty).
* Versions of a run resumed from an older version of its own directory continue
  above that directory's newest version, so the run's own checkpoints are
  never confused with (nor overwrite) the newer ones of the earlier run.

No torch.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from elasticdl.checkpoint import paths

logger = logging.getLogger(__name__)

NONE = "none"  # --restore_from=none: start empty


def init_dir(spec: Any) -> Optional[str]:
    """The init checkpoint's version directory, or None.

    Raises:
        CheckpointError: the init checkpoint has no complete version.
    """
    init = spec.checkpoint_dir_for_init
    if not init:
        return None
    return os.path.abspath(paths.resolve(init))


def run_base(spec: Any) -> int:
    """The version this run's numbering starts above: the init version, or the
    newest complete version of the run's own directory when that is newer (a run
    resumed from an older version of its own directory)."""
    base = 0
    vdir = init_dir(spec) if spec.checkpoint_dir_for_init else None
    if vdir is not None:
        base = paths.version_of(vdir)
    own = paths.complete_versions(spec.checkpoint_dir) if spec.checkpoint_dir else []
    if vdir is not None and own and own[-1] > base:
        base = own[-1]
    return base


def initial_source(spec: Any) -> str:
    """``--restore_from`` for a PS of the run's first launch."""
    return init_dir(spec) or NONE


def rollback_source(spec: Any, base: int, at_most: Optional[int] = None
                    ) -> Optional[dict[str, Any]]:
    """``{"dir": version dir, "checkpoint": version}`` every PS rolls back to when
    one is lost (the newest of this run: above its ``base``), or None (no checkpoint
    anywhere). With ``at_most`` (a divergence rollback) the newest at or below it, the
    run's base version included (under ``--on_divergence=rollback`` a PS writes the
    pushed model at once: version 0 of a new job, ``ps.main.initial_checkpoint``)."""
    lowest = base if at_most is not None else base + 1
    own = [v for v in (paths.complete_versions(spec.checkpoint_dir)
                       if spec.checkpoint_dir else [])
           if v >= lowest and (at_most is None or v <= at_most)]
    if own:
        return {"dir": os.path.abspath(paths.version_dir(spec.checkpoint_dir, own[-1])),
                "checkpoint": own[-1]}
    vdir = init_dir(spec)
    if vdir is not None and os.path.exists(os.path.join(vdir, paths.DONE)):
        return {"dir": vdir, "checkpoint": paths.version_of(vdir)}
    return None


def divergence_source(spec: Any, base: int, at_most: int,
                      previous: Optional[tuple[int, int]] = None,
                      window_versions: int = 0) -> Optional[dict[str, Any]]:
    """The source of a divergence rollback: :func:`rollback_source` at or below
    ``at_most`` (the rollback bound: the last version the model was seen good at; for
    a collapse the master's bound is a detector window before that, so ``at_most``
    within ``window_versions`` of a restart means a collapse begun within two windows
    of it). ``previous``: the last divergence rollback's (source checkpoint, version
    the job restarted at). A model whose bound is within ``window_versions`` of that
    restart, or whose source would be that checkpoint again, went bad from the
    restored state itself (async
    digits jobs: a model restored from checkpoint 10 collapsed 8 versions after the
    restart, its ReLUs already dying there, and each later rollback chose a checkpoint
    the dying model had written since): the source is older than the previous one,
    where there is one."""
    source = rollback_source(spec, base, at_most=at_most)
    if source is None or previous is None:
        return source
    before, restarted = previous
    if source["checkpoint"] != before and at_most >= restarted + window_versions:
        return source
    if before <= base:
        return source   # nothing older than the job's first model
    older = rollback_source(spec, base, at_most=before - 1)
    logger.warning("the model restored from checkpoint %d at version %d went bad again by "
                   "version %d: rolling back further, to checkpoint %s", before, restarted,
                   at_most, older and older["checkpoint"])
    return older or source


def allowed(spec: Any, version_dir: str) -> bool:
    """Whether a PS may restore ``version_dir`` (a rollback request names it): a
    complete version of the job's checkpoint directory or the init checkpoint."""
    vdir = os.path.abspath(version_dir)
    if not os.path.exists(os.path.join(vdir, paths.DONE)):
        return False
    if spec.checkpoint_dir and os.path.dirname(vdir) == os.path.abspath(spec.checkpoint_dir):
        return True
    return bool(spec.checkpoint_dir_for_init) and vdir == init_dir(spec)


def final_checkpoint(spec: Any, min_version: int) -> Optional[str]:
    """A complete checkpoint that holds the final model, or None: the newest
    version of the job's directory, else the init checkpoint (a resumed job with
    nothing left to train), that is at least ``min_version`` (the newest version
    this run's workers reported: never an older run's model) and whose data
    position leaves nothing pending in any of the job's epochs. What an
    allreduce job exports from when no member that trained is left (the
    exporter writes the final checkpoint before it exports,
    :mod:`elasticdl.worker.main`). Reads a version's trained records and its
    task table: O(tasks not closed).
    """
    from elasticdl.checkpoint import data_position

    candidates = []
    versions = paths.complete_versions(spec.checkpoint_dir) if spec.checkpoint_dir else []
    if versions:
        candidates.append(paths.version_dir(spec.checkpoint_dir, versions[-1]))
    try:
        init = init_dir(spec)
    except paths.CheckpointError:
        init = None
    if init is not None:
        candidates.append(init)
    for vdir in candidates:
        vdir = os.path.abspath(vdir)
        if paths.version_of(vdir) < min_version:
            continue
        try:
            found = data_position.read_position(vdir)
        except (paths.CheckpointError, OSError, ValueError):
            continue
        if found is not None and not found["pending"] and \
                int(found["epochs_created"]) >= spec.num_epochs:
            return vdir
    return None
