import os
import signal
import time

from elasticdl.cluster.api import Phase, ReplicaSpec, ReplicaType
from elasticdl.cluster.process import ProcessCluster


def spec(index, code):
    return ReplicaSpec("job", ReplicaType.WORKER, index,
                       ("python", "-c", f"import os,sys,time; print(os.environ['MY_POD_NAME'],"
                        f" os.environ['X']); sys.stdout.flush(); {code}"), env={"X": "42"})


def collect(cluster, n, timeout=20):
    events, deadline = [], time.monotonic() + timeout
    while len(events) < n and time.monotonic() < deadline:
        events += [e for e in cluster.poll_events(0.2) if e.phase != Phase.RUNNING]
    return {e.index: e for e in events}


def test_exit_codes_become_events_and_logs(tmp_path):
    cluster = ProcessCluster(str(tmp_path))
    try:
        cluster.create_replica(spec(0, "sys.exit(0)"))
        cluster.create_replica(spec(1, "sys.exit(3)"))
        cluster.create_replica(spec(2, "time.sleep(60)"))
        time.sleep(0.5)
        os.kill(cluster.pid_of(ReplicaType.WORKER, 2), signal.SIGKILL)
        cluster.create_replica(spec(3, "time.sleep(60)"))
        time.sleep(0.3)
        cluster.delete_replica(ReplicaType.WORKER, 3)
        events = collect(cluster, 4)
    finally:
        cluster.close()
    assert (events[0].phase, events[0].reason) == (Phase.SUCCEEDED, "completed")
    assert (events[1].phase, events[1].exit_code, events[1].reason) == (Phase.FAILED, 3, "error")
    assert (events[2].exit_code, events[2].reason) == (-9, "killed")
    assert events[3].phase == Phase.DELETED
    log = (tmp_path / "logs" / "worker-0.log").read_text()
    assert "job-worker-0 42" in log


def test_close_stops_everything_and_endpoints_are_stable(tmp_path):
    cluster = ProcessCluster(str(tmp_path))
    cluster.create_replica(spec(0, "time.sleep(600)"))
    pid = cluster.pid_of(ReplicaType.WORKER, 0)
    assert cluster.endpoint(ReplicaType.PS, 0) == cluster.endpoint(ReplicaType.PS, 0)
    cluster.close()
    assert not os.path.exists(f"/proc/{pid}")  # killed and reaped
