"""The job's model version and the bound on the versions workers report.

Workers report their model version with every task result and, for
progress, now and then. A version is validated against an upper bound: each
training minibatch makes at most one model version (Local and allreduce: one
step; PS: one push applied per PS, sync ones fewer), so no honest client
reports more than ``start + minibatches handed out`` (``start``: the version
the job resumed from or the PS rolled back to, whichever is larger). Above
that: :class:`VersionError` (INVALID_ARGUMENT on the wire). Older versions are
accepted and never move the job's version back.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("elasticdl.master.job")


class VersionError(ValueError):
    """A model version no task handed out so far could have produced."""


class ModelVersions:
    """The version ledger of the job core (``JobCore.versions``).

    It has no lock of its own: the core calls it under its lock (see
    :class:`elasticdl.master.core_base.CoreBase`). ``rollback_version`` (the
    version a PS rollback continued at) lives in the task manager and is
    passed in.
    """

    def __init__(self, start: int = 0) -> None:
        self.version = self.start = self.last_due = start
        self.minibatches_out = 0
        self.rollbacks_pending = 0   # PS rollbacks under way (JobCore.begin_rollback)

    def start_at(self, version: int) -> None:
        """The model the job starts from has ``version`` (a restored checkpoint)."""
        self.version = self.start = self.last_due = version

    def bound(self, rollback_version: int) -> int:
        """The highest version the job could have produced so far."""
        return max(self.start, rollback_version) + self.minibatches_out

    def handed_out(self, num_records: int, minibatch_size: int) -> None:
        """A training task of ``num_records`` went out: its minibatches may each
        make a version."""
        self.minibatches_out += -(-num_records // minibatch_size)

    def accept(self, worker_id: int, version: int, rollback_version: int,
               rolling_back: bool) -> bool:
        """``worker_id`` reports ``version``; True when it moved the job's version
        on. Raises VersionError above :meth:`bound` (a version during a PS
        rollback is ignored instead: the bound is unknown until it settles)."""
        bound = self.bound(rollback_version)
        if version > bound and rolling_back:
            logger.info("model version %d from worker %d during a PS rollback: ignored "
                        "until the rollback settles", version, worker_id)
            return False
        if version > bound:
            raise VersionError(
                f"model version {version} from worker {worker_id} is ahead of what the "
                f"job could have produced ({bound}: start version plus the training "
                "minibatches handed out so far)")
        if version <= self.version:
            return False  # stale or known: never moves anything back
        self.version = version
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "start": self.start, "last_due": self.last_due,
                "minibatches_out": self.minibatches_out,
                "rollbacks_pending": self.rollbacks_pending}

    def load_state_dict(self, v: dict[str, Any]) -> None:
        self.version, self.start = int(v["version"]), int(v["start"])
        self.last_due, self.minibatches_out = int(v["last_due"]), int(v["minibatches_out"])
        self.rollbacks_pending = int(v.get("rollbacks_pending", 0))
