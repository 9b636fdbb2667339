"""Task leases: several tasks handed to one worker in one call (``get_tasks``).

A worker whose tasks are short asks for up to ``max_tasks`` at once and keeps
them in a local buffer (:class:`elasticdl.worker.poller.LeasedTasks`). Every
leased task goes out through :meth:`JobCore.get_tasks` (the hand-outs of one
call in one journal record), so the master holds it exactly as one from
``get_task``: a dead worker's leased tasks are re-queued by ``recover_tasks``, a
straggler's reassigned after the timeout, an evaluation or an epoch barrier
waits for them.

The contract that makes a lease safe to retry: a worker asks only once it holds
nothing (every task it was given is reported, in the same request or before).
Tasks the master still counts as held by the asker were therefore leased by a
call whose reply was lost (a deadline, a master restart): they are handed back
first, instead of new ones, so no retry orphans a lease. What each worker was
leased last is kept here in memory (one tuple per worker); a restarted master,
which has none of it, looks the asker's held tasks up in the restored core once.

The lease size is bounded: at most what the worker asked for (it adapts that to
its task duration), at most :data:`MAX_LEASE`, and at most a fair share of the
tasks queued (so an epoch's tail is not leased to a few workers while the rest
wait).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from elasticdl.common.task import Task, TaskType

logger = logging.getLogger(__name__)

#: the most tasks one get_tasks call may ask for
MAX_LEASE = 64

_NOT_TASKS = (TaskType.WAIT, TaskType.NONE)


def tasks_held_by(core: Any, worker_id: int, among: Optional[tuple[int, ...]] = None
                  ) -> list[Task]:
    """The tasks ``worker_id`` holds now as their current holder (a straggler's
    reassigned task is not), of ``among`` (task ids) or of all held tasks."""
    doing = core.tm._doing
    if among is None:
        return [d.task for d in list(doing.values()) if d.worker_id == worker_id]
    held = []
    for task_id in among:
        d = doing.get(task_id)
        if d is not None and d.worker_id == worker_id:
            held.append(d.task)
    return held


class LeaseBook:
    """The servicer's leases: hands them out and hands a lost one back."""

    def __init__(self, core: Any):
        self.core = core
        self._last: dict[int, tuple[int, ...]] = {}   # worker -> task ids of its last lease

    def lease(self, worker_id: int, wanted: Optional[TaskType], max_tasks: int) -> list[Task]:
        """Up to ``max_tasks`` tasks for ``worker_id``, or one WAIT / NONE. The
        caller holds none (see the module): what the core says it holds is a lost
        lease, returned again."""
        core = self.core
        with core._lock:
            last = self._last.get(worker_id)
            if last is not None:
                held = tasks_held_by(core, worker_id, last)
            elif core.has_worked(worker_id):   # a restarted master: look it up once
                held = tasks_held_by(core, worker_id)
            else:
                held = []
            if held:
                logger.info("worker %d asked for tasks while holding %s: a lost reply; "
                            "handed back", worker_id, [t.task_id for t in held])
                self._last[worker_id] = tuple(t.task_id for t in held)
                return held
            tasks = core.get_tasks(worker_id, wanted, max_tasks,
                                   share=lambda: self._fair_share(worker_id))
            self._last[worker_id] = tuple(t.task_id for t in tasks if t.type not in _NOT_TASKS)
            return tasks

    def _fair_share(self, worker_id: int) -> int:
        """Tasks one lease may take (its first one taken): the queued ones over the
        workers (live ones, or those that leased), at least 1."""
        counts = self.core.tm.counts()
        queued = counts["todo"] + counts["eval_todo"] + 1
        workers = max(self.core.replicas.num_live(),
                      len(self._last) + (worker_id not in self._last))
        return max(1, -(-queued // workers))
