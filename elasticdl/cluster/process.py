"""``ProcessCluster``: every replica a local process, treated like a pod.

Each replica gets the command and environment a pod would (``python`` in the
command is this interpreter; ``MY_POD_IP``/``MY_POD_NAME`` are set as the
downward API would), its own log file under ``<job_dir>/logs/``, and its own
session so signals to the launcher do not reach it directly. A watcher thread
turns exits into :class:`ReplicaEvent` s: a negative return code (killed by a
signal) is reason ``"killed"``, a non-zero exit ``"error"``. The replica table
is mirrored to ``<job_dir>/replicas.json`` for ``elasticdl status``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO, Optional

from elasticdl.cluster.api import (
    Cluster,
    ClusterError,
    Phase,
    ReplicaEvent,
    ReplicaInfo,
    ReplicaSpec,
    ReplicaType,
)

logger = logging.getLogger(__name__)

STATE_FILE = "replicas.json"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def terminate(proc: subprocess.Popen | AdoptedProcess, grace_s: float = 10.0) -> Optional[int]:
    """SIGTERM a process (its whole session), SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return proc.returncode
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
            os.killpg(proc.pid, signal.SIGCONT)  # a stopped (hung) process acts on it now
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


REAPED_FILE = "reaped.json"


def reap_orphans(job_dir: str, pids: list[int]) -> None:
    """For the launcher of a local job, a child subreaper (see
    :func:`become_subreaper`): reap those of ``pids`` that were reparented to it
    (their master died) and exited, recording their exit codes in
    ``<job_dir>/reaped.json`` for the master that adopted them."""
    codes = {}
    for pid in pids:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue  # not ours (still the master's child) or gone
        if got == pid:
            codes[str(pid)] = os.waitstatus_to_exitcode(status)
    if codes:
        path = os.path.join(job_dir, REAPED_FILE)
        try:
            with open(path) as f:
                known = json.load(f)
        except (OSError, ValueError):
            known = {}
        known.update(codes)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(known, f)
        os.replace(tmp, path)


def become_subreaper() -> bool:
    """Orphaned descendants (the replicas of a master that died) become this
    process's children instead of init's, so their exit codes can be read."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0   # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


class AdoptedProcess:
    """A replica process another master started (now dead): not our child, so
    it is watched by polling its pid. Its exit code comes from the launcher
    that reaped it (``reaped.json``, see :func:`reap_orphans`); unknown (no
    reaper within a few seconds), it counts as 1, an error."""

    def __init__(self, pid: int, job_dir: str):
        self.pid = pid
        self.job_dir = job_dir
        self.returncode: Optional[int] = None
        self._dead_since: Optional[float] = None

    def poll(self) -> Optional[int]:
        if self.returncode is not None or pid_alive(self.pid):
            return self.returncode
        try:
            with open(os.path.join(self.job_dir, REAPED_FILE)) as f:
                code = json.load(f).get(str(self.pid))
        except (OSError, ValueError):
            code = None
        if code is not None:
            self.returncode = int(code)
        else:
            now = time.monotonic()
            self._dead_since = self._dead_since or now
            if now - self._dead_since > 5.0:
                self.returncode = 1
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not) and is an elasticdl process (guards
    against pid reuse)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X") and b"elasticdl" in cmdline


@dataclass
class _Replica:
    spec: ReplicaSpec
    proc: subprocess.Popen | AdoptedProcess
    log: IO[bytes]
    started: float
    deleting: bool = False
    phase: Phase = Phase.RUNNING
    exit_code: Optional[int] = None


class ProcessCluster(Cluster):
    """Replicas as local processes under ``job_dir``."""

    def __init__(self, job_dir: str, host: str = "127.0.0.1", poll_s: float = 0.05):
        self.job_dir = job_dir
        self.host = host
        self.log_dir = os.path.join(job_dir, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self._lock = threading.Lock()
        self._state_lock = threading.Lock()   # one writer of replicas.json at a time
        self._replicas: dict[tuple[ReplicaType, int], _Replica] = {}
        self._history: list[dict[str, object]] = []
        self._ports: dict[tuple[ReplicaType, int], int] = {}
        self._events: queue.Queue[ReplicaEvent] = queue.Queue()
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._watcher = threading.Thread(target=self._watch, name="process-watch", daemon=True)
        self._watcher.start()

    def endpoint(self, type: ReplicaType, index: int) -> tuple[int, str]:
        with self._lock:
            port = self._ports.setdefault((type, index), free_port(self.host))
        return port, f"{self.host}:{port}"

    def log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    def create_replica(self, spec: ReplicaSpec) -> None:
        if self._stop.is_set():
            raise ClusterError("cluster is closed")
        command = list(spec.command)
        if command and command[0] == "python":
            command[0] = sys.executable
        env = dict(os.environ)
        env.update(spec.env)
        env.update({"MY_POD_IP": self.host, "MY_POD_NAME": f"{spec.job_name}-{spec.name}",
                     "PYTHONUNBUFFERED": "1"})
        log = open(self.log_path(spec.name), "ab")
        log.write(f"==== {time.strftime('%H:%M:%S')} start {spec.name}: "
                  f"{' '.join(command)[:300]}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            log.close()
            raise ClusterError(f"cannot start {spec.name}: {e}") from e
        with self._lock:
            self._replicas[(spec.type, spec.index)] = _Replica(spec, proc, log, time.time())
        logger.info("started %s (pid %d), log %s", spec.name, proc.pid,
                    self.log_path(spec.name))
        self._events.put(ReplicaEvent(spec.type, spec.index, Phase.RUNNING))
        self._write_state()

    def pid_of(self, type: ReplicaType, index: int) -> Optional[int]:
        with self._lock:
            rep = self._replicas.get((type, index))
            return rep.proc.pid if rep is not None else None

    def delete_replica(self, type: ReplicaType, index: int) -> None:
        with self._lock:
            rep = self._replicas.get((type, index))
            if rep is None:
                return
            rep.deleting = True
        terminate(rep.proc)

    def poll_events(self, timeout_s: float) -> list[ReplicaEvent]:
        events = []
        try:
            events.append(self._events.get(timeout=timeout_s))
            while True:
                events.append(self._events.get_nowait())
        except queue.Empty:
            pass
        return events

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            self._reap()

    def _reap(self) -> None:
        exited = []
        with self._lock:
            for key, rep in list(self._replicas.items()):
                code = rep.proc.poll()
                if code is None:
                    continue
                del self._replicas[key]
                rep.log.close()
                exited.append((key, rep, code))
        for (typ, index), rep, code in exited:
            if rep.deleting:
                phase, reason = Phase.DELETED, "deleted"
            elif code == 0:
                phase, reason = Phase.SUCCEEDED, "completed"
            elif code < 0:
                phase, reason = Phase.FAILED, "killed"
            else:
                phase, reason = Phase.FAILED, "error"
            logger.info("%s exited with %d (%s)", rep.spec.name, code, reason)
            with self._lock:
                self._history.append({"replica": rep.spec.name, "pid": rep.proc.pid,
                                      "phase": phase.value, "exit_code": code,
                                      "reason": reason})
            self._events.put(ReplicaEvent(typ, index, phase, code, reason))
        if exited:
            self._write_state()

    def _write_state(self) -> None:
        """Mirror the replica table to ``replicas.json`` atomically.

        Called from the launching thread and the reaper thread alike: the
        snapshot, the write and the rename happen under one lock, each through
        a temp file of its own, so neither can rename the other's file away.
        An I/O error here is logged, never raised into the caller (the file is
        a mirror for ``elasticdl status``; the job must not die for it).
        """
        with self._state_lock:
            with self._lock:
                live = [{"replica": r.spec.name, "pid": r.proc.pid, "phase": "running",
                         "started": r.started, "port": r.spec.port,
                         "address": f"{self.host}:{r.spec.port}" if r.spec.port else ""}
                        for r in self._replicas.values()]
                # every port handed out, live or not: a PS that died while the master
                # was down is relaunched by the next master at the address the workers
                # already hold (one entry per PS index: bounded by --num_ps_pods)
                ports = {f"{t.value}-{i}": p for (t, i), p in self._ports.items()}
                state = {"replicas": live, "exited": list(self._history[-200:]),
                         "ports": ports}
            path = os.path.join(self.job_dir, STATE_FILE)
            try:
                fd, tmp = tempfile.mkstemp(prefix=STATE_FILE + ".", suffix=".tmp",
                                           dir=self.job_dir)
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump(state, f, indent=1)
                    os.replace(tmp, path)
                except BaseException:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                    raise
            except OSError as e:
                logger.error("cannot write %s: %s", path, e)

    def adopt_replicas(self) -> list[ReplicaInfo]:
        """The replicas ``replicas.json`` lists as running whose processes still
        run: watched from now on (by polling their pids), their ports kept."""
        path = os.path.join(self.job_dir, STATE_FILE)
        try:
            with open(path) as f:
                state = json.load(f)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            raise ClusterError(f"cannot read {path}: {e}") from e
        for name, port in dict(state.get("ports", {})).items():
            typ_name, _, index = str(name).rpartition("-")
            with self._lock:
                self._ports[(ReplicaType(typ_name), int(index))] = int(port)
        adopted = []
        for r in state.get("replicas", []):
            typ_name, _, index = str(r["replica"]).rpartition("-")
            typ, idx, pid = ReplicaType(typ_name), int(index), int(r["pid"])
            port = int(r.get("port", 0))
            if port:
                with self._lock:
                    self._ports[(typ, idx)] = port
            if not pid_alive(pid):
                logger.warning("%s (pid %d) is gone: not adopted", r["replica"], pid)
                continue
            spec = ReplicaSpec(job_name="", type=typ, index=idx, command=(), port=port)
            log = open(self.log_path(spec.name), "ab")
            with self._lock:
                self._replicas[(typ, idx)] = _Replica(spec, AdoptedProcess(pid, self.job_dir), log,
                                                      float(r.get("started", time.time())))
            adopted.append(ReplicaInfo(typ, idx, Phase.RUNNING, port,
                                       f"{self.host}:{port}" if port else "", str(pid)))
            logger.info("adopted %s (pid %d)", spec.name, pid)
        with self._lock:
            self._history = list(state.get("exited", []))
        self._write_state()
        return adopted

    def close(self) -> None:
        """Terminate every live replica (SIGTERM, then SIGKILL) and stop watching."""
        with self._lock:
            reps = list(self._replicas.values())
            for rep in reps:
                rep.deleting = True
        threads = [threading.Thread(target=terminate, args=(r.proc,)) for r in reps]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        self._reap()
        self._stop.set()
        self._watcher.join(timeout=5)
