"""The job history file (elasticdl/master/job_history.py) written from two threads."""

from __future__ import annotations

import json
import os
import threading
from types import SimpleNamespace

from elasticdl.master.job_history import HISTORY, HistoryWriter


def _core(version: int) -> SimpleNamespace:
    report = SimpleNamespace(epochs=[{"records_completed": 8 * version}], records_at_start=0,
                             evaluations=[{"model_version": version, "metrics": {"a": 0.5}}],
                             final_metrics={}, training={"loss": 0.1})
    return SimpleNamespace(report=report, version=version)


def test_the_report_refresh_and_an_evaluation_may_record_at_once(tmp_path):
    """The controller's refresh and an evaluation's gRPC thread both call record(): each
    write completes and the file is always whole JSON with the newest snapshot."""
    writer = HistoryWriter(str(tmp_path))
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(offset: int) -> None:
        start.wait()
        try:
            for v in range(300):
                writer.record(_core(2 * v + offset), float(v))
        except BaseException as e:   # (the unserialised writer: FileNotFoundError)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:1]
    with open(os.path.join(str(tmp_path), HISTORY)) as f:
        snaps = json.load(f)["snapshots"]
    assert snaps and max(s["version"] for s in snaps) >= 598
