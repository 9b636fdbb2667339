"""Relaunch bookkeeping of the job core: worker ids and lineages, live workers,
each replica's own failures, the exporter claim and the job's root cause.

Decisions only; the job controller applies them on the cluster. Its state is
a JSON-able dict (:meth:`ReplicaBook.state_dict`). Thread-safe. No torch.
"""

from __future__ import annotations

import threading
from typing import Any, Optional


class ReplicaBook:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.next_worker_id = 0
        self.live_workers: set[int] = set()
        self.lineage: dict[int, int] = {}          # worker id -> first id of its lineage
        self.own_failures: dict[str, int] = {}     # "worker:<lineage>" / "ps:<i>" -> count
        self.failures: dict[int, tuple[str, str]] = {}   # worker -> first (message, traceback)
        self.first_failure: Optional[tuple[str, str, str]] = None  # replica, message, tb
        self.exporter: Optional[int] = None
        self.exporter_done = False

    def new_worker(self, lineage: Optional[int] = None) -> int:
        """A fresh worker id (never reused), live from now; ``lineage``: the first
        id of the worker it replaces."""
        with self._lock:
            worker_id = self.next_worker_id
            self.next_worker_id += 1
            self.live_workers.add(worker_id)
            self.lineage[worker_id] = worker_id if lineage is None else lineage
            return worker_id

    def lineage_of(self, worker_id: int) -> int:
        with self._lock:
            return self.lineage.get(worker_id, worker_id)

    def worker_gone(self, worker_id: int, succeeded: bool) -> None:
        """A worker ended; a failed exporter frees the export for another worker."""
        with self._lock:
            self.live_workers.discard(worker_id)
            if worker_id == self.exporter:
                if succeeded:
                    self.exporter_done = True
                else:
                    self.exporter = None

    def is_live(self, worker_id: int) -> bool:
        with self._lock:
            return worker_id in self.live_workers

    def num_live(self) -> int:
        with self._lock:
            return len(self.live_workers)

    def count_failure(self, key: str, counts: bool) -> int:
        """A replica (``key``: its kind and lineage) ended; returns its own failures so
        far, counting this one when ``counts`` (not killed, deleted or preempted)."""
        with self._lock:
            if counts:
                self.own_failures[key] = self.own_failures.get(key, 0) + 1
            return self.own_failures.get(key, 0)

    def worker_reported(self, worker_id: int, message: str, traceback: str) -> None:
        """A worker's own report of its first exception."""
        with self._lock:
            self.failures.setdefault(worker_id, (message, traceback))
            if self.first_failure is None:
                self.first_failure = (f"worker-{worker_id}", message, traceback)

    def note_exit(self, worker_id: int, replica: str, fallback: str) -> None:
        """A worker failed: the job's root cause is the first one (its own report
        when it sent one, else ``fallback``, e.g. its exit code)."""
        with self._lock:
            if self.first_failure is None:
                message, tb = self.failures.get(worker_id, (fallback, ""))
                self.first_failure = (replica, message, tb)

    def claim_export(self, worker_id: int) -> bool:
        """The first worker to ask exports the final model."""
        with self._lock:
            if self.exporter is None:
                self.exporter = worker_id
                return True
            return False

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"next_worker_id": self.next_worker_id,
                    "live_workers": sorted(self.live_workers),
                    "lineage": {str(k): v for k, v in self.lineage.items()},
                    "own_failures": dict(self.own_failures),
                    "failures": {str(k): list(v) for k, v in self.failures.items()},
                    "first_failure": list(self.first_failure) if self.first_failure else None,
                    "exporter": self.exporter, "exporter_done": self.exporter_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.next_worker_id = int(state["next_worker_id"])
            self.live_workers = set(state["live_workers"])
            self.lineage = {int(k): int(v) for k, v in state["lineage"].items()}
            self.own_failures = {k: int(v) for k, v in state["own_failures"].items()}
            self.failures = {int(k): (v[0], v[1]) for k, v in state["failures"].items()}
            first = state["first_failure"]
            self.first_failure = (first[0], first[1], first[2]) if first else None
            self.exporter = state["exporter"]
            self.exporter_done = bool(state["exporter_done"])
