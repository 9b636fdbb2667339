"""A job's history in its checkpoint directory, so a resumed job reports the whole job.

``<checkpoint_dir>/job_history.json`` (torch-free; written atomically by whoever
runs the job core: the master, or a Local job) holds the report's history as it
was at a few recent model versions (a ring of :data:`KEEP` snapshots, taken when
a checkpoint is written in process and whenever the report is refreshed):
its evaluations, its per-epoch training figures, the metric-driven LR
schedule's state and the runs so far (records trained and wall time of each).

A job resumed from the checkpoint of version ``V`` (``--checkpoint_dir_for_init``)
starts its report from the newest snapshot taken at a version ``<= V``: the
evaluations of versions up to ``V`` (exact: evaluations are labelled with the
version they evaluated), the training figures of that snapshot (a distributed
job's snapshot may be a few seconds older than ``V``: the training loss and
rates of the tasks in between are then missing from ``training``, never counted
twice), and the metric schedule's state recomputed from those evaluations. Its
``timings`` then give this run's records per second (records trained in this
run / its wall time) and the earlier runs' figures apart.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

from elasticdl.checkpoint.paths import resolve, version_of
from elasticdl.common.enums import JobType

logger = logging.getLogger(__name__)

HISTORY = "job_history.json"
KEEP = 16


def _read(checkpoint_dir: str) -> dict[str, Any]:
    path = os.path.join(checkpoint_dir, HISTORY)
    try:
        with open(path, encoding="utf-8") as f:
            return dict(json.load(f))
    except FileNotFoundError:
        return {"snapshots": []}
    except ValueError as e:
        logger.warning("%s is unreadable (%s): the resumed report starts empty", path, e)
        return {"snapshots": []}


class HistoryWriter:
    """Records the job core's report history at its current version."""

    def __init__(self, checkpoint_dir: str, snapshots: Optional[list[dict[str, Any]]] = None,
                 earlier_runs: Optional[list[dict[str, Any]]] = None):
        self.checkpoint_dir = checkpoint_dir
        self.path = os.path.join(checkpoint_dir, HISTORY)
        self._snapshots: list[dict[str, Any]] = list(snapshots or [])
        self._earlier_runs: list[dict[str, Any]] = list(earlier_runs or [])
        # record() runs on the controller's report refresh and on each evaluation's
        # gRPC thread: unserialised, two writes of the one .tmp file raced and the
        # second os.replace found no file (a `make demo` master failed on it)
        self._lock = threading.Lock()

    def record(self, core: Any, wall_s: float) -> None:
        """Snapshot ``core``'s report history at ``core.version`` and write the file
        (thread-safe)."""
        with self._lock:
            self._record(core, wall_s)

    def _record(self, core: Any, wall_s: float) -> None:
        report = core.report
        records = sum(int(e.get("records_completed", 0)) for e in report.epochs)
        this_run = {"records": records - report.records_at_start, "wall_s": round(wall_s, 3)}
        snap = {"version": int(core.version),
                "evaluations": copy.deepcopy(report.evaluations),
                "final_metrics": dict(report.final_metrics),
                "training": copy.deepcopy(report.training),
                "runs": self._earlier_runs + [this_run]}
        if self._snapshots and self._snapshots[-1]["version"] == snap["version"]:
            self._snapshots[-1] = snap
        else:
            self._snapshots.append(snap)
        self._snapshots = self._snapshots[-KEEP:]
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"snapshots": self._snapshots}, f, separators=(",", ":"))
        os.replace(tmp, self.path)


def attach(core: Any, spec: Any, restoring: bool = False,
           clock: Callable[[], float] = time.time) -> Optional[HistoryWriter]:
    """The call site of a job core's runner (the master, a Local job) once the core
    has its data position: a resumed job (``--checkpoint_dir_for_init``) starts its
    report from the checkpoint's history; with ``--checkpoint_dir`` the history is
    recorded there at every report refresh. ``restoring``: a restarted master (its
    report comes from the journal; the file's snapshots are kept)."""
    if spec.job_type != JobType.TRAIN:
        return None
    snap = None
    if not restoring and spec.checkpoint_dir_for_init:
        snap = snapshot_for(spec.checkpoint_dir_for_init)
        resume_report(core, snap)
    if not spec.checkpoint_dir:
        return None
    if restoring:
        snaps = _read(spec.checkpoint_dir)["snapshots"]
    else:  # a resumed run's file starts over with the snapshot it resumed from
        snaps = [snap] if snap is not None else []
    writer = HistoryWriter(spec.checkpoint_dir, snaps,
                           core.report.extra.get("earlier_runs", []))
    started = core.report.started
    core.refresh_hooks.append(lambda c: writer.record(c, clock() - started))
    core.add_listener(_AtEvaluation(core, writer, lambda: clock() - started))
    return writer


class _AtEvaluation:
    """Records the history as each evaluation completes (a job killed right after
    its final evaluation still has it in its history)."""

    def __init__(self, core: Any, writer: HistoryWriter, wall: Callable[[], float]):
        self.core, self.writer, self.wall = core, writer, wall

    def on_evaluation(self, version: int, metrics: dict[str, float]) -> None:
        self.writer.record(self.core, self.wall())

    def __getattr__(self, name: str) -> Any:   # the other JobListener events: nothing
        if name.startswith("on_"):
            return lambda **fields: None
        raise AttributeError(name)


def snapshot_for(init_path: str) -> Optional[dict[str, Any]]:
    """The history to resume from for ``init_path`` (a checkpoint directory or one
    of its ``version-N`` directories): the newest snapshot at a version ``<=`` the
    checkpoint's, its evaluations limited to that version; None without one."""
    vdir = resolve(init_path)
    version = version_of(vdir)
    snaps = [s for s in _read(os.path.dirname(os.path.normpath(vdir)))["snapshots"]
             if int(s["version"]) <= version]
    if not snaps:
        logger.warning("%s has no job history at or before version %d: the report covers "
                       "this run only", init_path, version)
        return None
    snap = dict(snaps[-1])
    newest = _read(os.path.dirname(os.path.normpath(vdir)))["snapshots"][-1]
    # evaluations are labelled with their version: take every one up to the checkpoint's
    snap["evaluations"] = [e for e in newest["evaluations"]
                           if int(e["model_version"]) <= version]
    finals = [e for e in snap["evaluations"] if "final" in e.get("reasons", [])]
    snap["final_metrics"] = dict(finals[-1]["metrics"]) if finals else {}
    snap["resumed_from_version"] = version
    return snap


def resume_report(core: Any, snap: Optional[dict[str, Any]]) -> None:
    """Start ``core``'s report (and metric schedule) from ``snap``; records already
    in the model (the resumed data position) do not count as this run's."""
    report = core.report
    report.records_at_start = sum(int(e.get("records_completed", 0))
                                  for e in core.tm.epochs_report())
    if snap is None:
        return
    report.evaluations = copy.deepcopy(snap["evaluations"])
    report.final_metrics = dict(snap.get("final_metrics", {}))
    report.training = copy.deepcopy(snap["training"])
    report.extra["earlier_runs"] = list(snap.get("runs", []))
    report.extra["resumed_from_version"] = int(snap["resumed_from_version"])
    ms = getattr(core, "metric_schedule", None)
    if ms is not None:   # the schedule's state: its rule over the evaluations so far
        for e in sorted(report.evaluations, key=lambda e: e["model_version"]):
            ms.on_evaluation(int(e["model_version"]), e["metrics"])
        report.extra["lr_schedule"] = ms.summary()
    logger.info("resumed report: %d earlier evaluation(s), %d earlier run(s), training of "
                "epoch(s) %s", len(report.evaluations), len(report.extra["earlier_runs"]),
                sorted(report.training, key=int))
