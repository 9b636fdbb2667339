"""The kinds of record in the job core's journal (:mod:`elasticdl.master.journal`).

The values are the journal's format: a value once written is never renamed
(tests/fixtures/journal_v1 holds a journal of the first format).
"""

from __future__ import annotations

import enum


class Op(str, enum.Enum):
    """The journal's record kinds: one per journaled JobCore transition. A new
    transition adds a member here and its replay in
    :data:`elasticdl.master.job_replay.HANDLERS`."""

    GET = "get"
    REPORT = "report"
    LEASE = "lease"                     # several gets of one call (get_tasks)
    REPORTS = "reports"                 # several reports of one call
    METRICS = "metrics"
    VERSION = "version"
    BEGIN = "begin"
    RECOVER = "recover"
    ROLLBACK = "rollback"
    SETTLE = "settle"
    BEGIN_ROLLBACK = "begin_rollback"   # journals written before the rollback protocol
    END_ROLLBACK = "end_rollback"
    START_AT = "start_at"
    EXPORT = "export"
    WORKER_REPORTED = "worker_reported"
    # recovery protocols and replica identities (elasticdl.master.recovery)
    INCARNATION = "incarnation"
    PS_LOST = "ps_lost"
    PROTOCOL_STEP = "protocol_step"
    ROLLBACK_REQUEUED = "rollback_requeued"
    PROTOCOL_CLOSE = "protocol_close"
    EXPORT_WRITTEN = "export_written"
    EXPORT_LOST = "export_lost"
    EXPORT_OPEN = "export_open"
    LAUNCH = "launch"
    GONE = "gone"
    NOTE_EXIT = "note_exit"
    RESIZE = "resize"                   # elasticdl scale: new worker bounds (scaling.py)
    HEALTH_RESTART = "health_restart"   # the loss is judged afresh (a divergence rollback)
    DIVERGED = "diverged"               # a divergence rollback opens (--on_divergence)
