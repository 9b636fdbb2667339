"""Issue 11: the master's replica bookkeeping cannot race, and a crash in its
relaunch path fails the job with the cause in the report (never `running`)."""

from __future__ import annotations

import json
import os
import threading

from elasticdl.cluster.api import ClusterError, Phase, ReplicaType
from elasticdl.cluster.process import STATE_FILE, ProcessCluster
from tests.unit.master.test_master import controller, ev


def test_replicas_json_survives_concurrent_writers(tmp_path):
    """Reproduces `FileNotFoundError: replicas.json.tmp -> replicas.json`: the
    launcher and the reaper thread both mirror the table at once."""
    cluster = ProcessCluster(str(tmp_path))
    errors: list[BaseException] = []

    def hammer():
        try:
            for _ in range(300):
                cluster._write_state()
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=hammer) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        cluster.close()
    assert errors == []
    with open(tmp_path / STATE_FILE) as f:
        assert set(json.load(f)) == {"replicas", "exited", "ports"}
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


class _BrokenOnRelaunch(Exception):
    pass


def test_crash_in_relaunch_path_fails_job_with_cause(tmp_path):
    ctl, cluster, tm, report = controller(tmp_path)
    ctl.start()

    def broken_create(spec):
        raise _BrokenOnRelaunch(f"disk full while starting {spec.name}")

    cluster.create_replica = broken_create  # the relaunch itself blows up
    cluster.pending.append(ev(1, Phase.FAILED, -9, "killed"))
    assert ctl.run(threading.Event()) == "failed"
    assert report.failure["replica"] == "master"
    assert "disk full while starting worker-2" in report.failure["error"]
    assert "_BrokenOnRelaunch" in report.failure["traceback"]
    with open(tmp_path / "job_report.json") as f:
        assert json.load(f)["status"] == "failed"


def test_cluster_error_on_relaunch_fails_job(tmp_path):
    ctl, cluster, tm, report = controller(tmp_path)
    ctl.start()

    def refuse(spec):
        raise ClusterError("quota exceeded")

    cluster.create_replica = refuse
    cluster.pending.append(ev(0, Phase.FAILED, -9, "killed", ReplicaType.WORKER))
    assert ctl.run(threading.Event()) == "failed"
    assert "quota exceeded" in report.failure["error"]
