"""A relaunched master takes over its job (master failover).

The master journals its job core in ``<job_dir>/journal`` (:mod:`journal`).
Started with ``--restore`` it restores the core from there, adopts the
replicas still running (:meth:`Cluster.adopt_replicas`) instead of starting
new ones, handles the ones that died meanwhile as killed (only their held work
is re-queued) and records the restart in the job report
(``master_restarts``: when, why, downtime, records redone because of it). The
launcher that relaunched it (the ``elasticdl`` client for a local job) notes
each death in ``<job_dir>/master_restarts.json``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Any

from elasticdl.checkpoint.data_position import TABLE, TaskTable
from elasticdl.cluster.api import Cluster
from elasticdl.common.enums import JobType
from elasticdl.master.job import JobCore
from elasticdl.master.job_controller import JobController
from elasticdl.master.journal import (
    JOURNAL_DIR,
    LOCK_FILE,
    RESTARTS_FILE,
    Journal,
    JournalOwner,
)

logger = logging.getLogger(__name__)


RESTORE_LOCK_WAIT_S = 90.0   # a restoring master waits this long for the one it replaces


def open_journal(job_dir: str, restore: bool,
                 lock_wait_s: float = RESTORE_LOCK_WAIT_S) -> tuple[Journal, bool]:
    """The job's journal, owned by this master until it is closed, and whether to
    restore from it (``restore`` and there is one); a fresh start discards an old
    one. A restoring master first waits up to ``lock_wait_s`` for the master it
    replaces to release the journal (a pod being deleted serves and journals its
    last RPCs); a fresh start fails at once when another master holds it.

    Raises:
        JournalLockedError: another master holds the journal (the message names it).
    """
    owner = JournalOwner(os.path.join(job_dir, LOCK_FILE))
    owner.acquire(lock_wait_s if restore else 0.0)
    path = os.path.join(job_dir, JOURNAL_DIR)
    try:
        if not restore and os.path.exists(path):
            shutil.rmtree(path)
        journal = Journal(path, owner=owner)
    except BaseException:
        owner.release()
        raise
    restoring = restore and journal.exists()
    if restore and not restoring:
        logger.warning("--restore: no journal in %s; starting the job afresh", path)
    return journal, restoring


class _AppendedTable(TaskTable):
    """The run's task table (data position), appended to by a relaunched master."""

    def __init__(self, checkpoint_dir: str):  # noqa: D107 - no call to super: no new table
        self.path = os.path.join(checkpoint_dir, TABLE)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def reopen_task_table(core: JobCore, spec: Any) -> None:
    """Tasks the restored core creates go on into the run's task table."""
    if spec.job_type == JobType.TRAIN and spec.checkpoint_dir:
        core.tm.block_created_callbacks.append(_AppendedTable(spec.checkpoint_dir).record)


def last_journaled(job_dir: str) -> float:
    """When the dead master last wrote its journal (about when it died)."""
    path = os.path.join(job_dir, JOURNAL_DIR)
    times = [os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)]
    return max(times, default=time.time())


def _launcher_notes(job_dir: str) -> list[dict[str, Any]]:
    try:
        with open(os.path.join(job_dir, RESTARTS_FILE)) as f:
            notes = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        logger.warning("cannot read %s: %s", RESTARTS_FILE, e)
        return []
    return notes if isinstance(notes, list) else []


def redone_records(core: JobCore) -> int:
    return sum(e["records_redone"] for e in core.tm.epochs_report())


def take_over(controller: JobController, cluster: Cluster, job_dir: str) -> dict[str, Any]:
    """Adopt the running replicas, handle the lost ones, record the restart; the
    report's entry for it."""
    died_at = last_journaled(job_dir)
    core = controller.core
    adopted = cluster.adopt_replicas()
    before = redone_records(core)
    lost = controller.adopt(adopted, cluster.finished_replicas())
    restarts = core.report.extra.setdefault("master_restarts", [])
    notes = _launcher_notes(job_dir)
    note = notes[len(restarts)] if len(notes) > len(restarts) else {}
    died_at = float(note.get("died_at", died_at))
    entry = {"restart": len(restarts) + 1, "at": time.time(),
             "reason": note.get("reason", "master relaunched"),
             "exit_code": note.get("exit_code"),
             "downtime_s": round(time.time() - died_at, 3),
             "records_redone": redone_records(core) - before,
             "replicas_adopted": sorted(r.name for r in adopted), "replicas_lost": lost}
    restarts.append(entry)
    core.snapshot()
    logger.warning("master restart %d: adopted %s, lost %s, down %.1f s, %d record(s) redone",
                   entry["restart"], ", ".join(entry["replicas_adopted"]) or "none",
                   ", ".join(lost) or "none", entry["downtime_s"], entry["records_redone"])
    return entry
