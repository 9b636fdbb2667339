"""ProcessCluster.adopt_replicas: a restarted master takes over the replica
processes of the one that died (pids and ports from replicas.json), watches
them by polling, and learns their exit codes from the launcher that reaped
them (reaped.json)."""

from __future__ import annotations

import os
import signal
import time

from elasticdl.cluster.api import Phase, ReplicaSpec, ReplicaType
from elasticdl.cluster.process import ProcessCluster, reap_orphans

SLEEPER = ("python", "-c", "import sys, time; time.sleep(float(sys.argv[1]))", "60",
           "elasticdl-test")


def events_until(cluster, pred, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        seen += cluster.poll_events(0.2)
        if any(pred(e) for e in seen):
            return seen
    raise AssertionError(f"no such event within {timeout_s} s: {seen}")


def test_adopted_replicas_are_watched_and_their_exit_codes_reported(tmp_path):
    job_dir = str(tmp_path)
    dead = ProcessCluster(job_dir)          # the master that dies
    dead.create_replica(ReplicaSpec("j", ReplicaType.PS, 0, SLEEPER, port=4321))
    dead.create_replica(ReplicaSpec("j", ReplicaType.WORKER, 0, SLEEPER))
    gone = ReplicaSpec("j", ReplicaType.WORKER, 1, ("python", "-c", "pass", "elasticdl"))
    dead.create_replica(gone)
    events_until(dead, lambda e: e.index == 1 and e.phase == Phase.SUCCEEDED)
    dead._stop.set()                        # its watcher dies with it: nobody reaps
    dead._watcher.join(timeout=5)
    pids = {r: dead.pid_of(ReplicaType(r.split("-")[0]), int(r.split("-")[1]))
            for r in ("ps-0", "worker-0")}
    new = ProcessCluster(job_dir)
    try:
        adopted = {r.name: r for r in new.adopt_replicas()}
        assert sorted(adopted) == ["ps-0", "worker-0"]   # worker-1 had exited
        assert adopted["ps-0"].port == 4321 and adopted["ps-0"].ident == str(pids["ps-0"])
        assert new.endpoint(ReplicaType.PS, 0)[0] == 4321   # a relaunched PS keeps its port
        os.kill(pids["worker-0"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not os.path.exists(os.path.join(job_dir, "reaped.json")):
            reap_orphans(job_dir, list(pids.values()))    # the launcher, as subreaper
            assert time.monotonic() < deadline
            time.sleep(0.05)
        seen = events_until(new, lambda e: e.name == "worker-0" and e.phase == Phase.FAILED)
        ev = next(e for e in seen if e.name == "worker-0" and e.phase == Phase.FAILED)
        assert (ev.exit_code, ev.reason) == (-9, "killed")
    finally:
        new.close()                          # terminates the adopted PS too
    assert not os.path.exists(f"/proc/{pids['ps-0']}") or \
        open(f"/proc/{pids['ps-0']}/stat").read().split(")")[1].split()[0] == "Z"


def test_a_ps_that_died_while_the_master_was_down_keeps_its_port(tmp_path):
    """The PS exited before the master died: the next master relaunches it at the port
    the workers hold (a new port left them retrying the old one until their 120 s PS
    timeout failed their tasks: test_ps_death_then_master_death_before_ps_launch took
    150 s for it)."""
    job_dir = str(tmp_path)
    dead = ProcessCluster(job_dir)
    port, _ = dead.endpoint(ReplicaType.PS, 1)
    dead.create_replica(ReplicaSpec("j", ReplicaType.PS, 1, ("python", "-c", "pass",
                                                             "elasticdl"), port=port))
    events_until(dead, lambda e: e.name == "ps-1" and e.phase == Phase.SUCCEEDED)
    dead._stop.set()
    dead._watcher.join(timeout=5)
    new = ProcessCluster(job_dir)
    try:
        assert new.adopt_replicas() == []
        assert new.endpoint(ReplicaType.PS, 1)[0] == port
        assert new.endpoint(ReplicaType.PS, 0)[0] != port
    finally:
        new.close()
