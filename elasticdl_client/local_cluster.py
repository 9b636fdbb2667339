"""``--cluster=local``: the job's master (and through it every PS and worker) as
local processes under the job directory, plus ``status``, ``logs`` and ``stop``
for such jobs.

Layout of a job directory::

    job_spec.json  master.json (pid, port)  replicas.json  job_report.json
    logs/master.log  logs/worker-0.log  logs/ps-0.log ...
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, Optional

from elasticdl.cluster.process import (
    STATE_FILE,
    become_subreaper,
    free_port,
    reap_orphans,
    terminate,
)
from elasticdl.common import auth, entry_points
from elasticdl.common.job_dirs import named_job_dir, register_job_dir
from elasticdl.common.job_report import REPORT_NAME
from elasticdl.common.job_spec import JobSpec
from elasticdl.master.journal import (
    JOURNAL_DIR,
    LOCK_FILE,
    RESTARTS_FILE,
    JournalLockedError,
    JournalOwner,
)
from elasticdl_client import job_figures

MASTER_FILE = "master.json"
STOP_FILE = "stop_requested"   # `elasticdl stop` ran: a master that dies is not relaunched


class JobNotFound(LookupError):
    pass


def _follow(path: str, pos: int, out: Any) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(pos)
            chunk = f.read()
    except FileNotFoundError:
        return pos
    if chunk:
        out.write(chunk.decode(errors="replace"))
        out.flush()
    return pos + len(chunk)


def _refuse_a_running_job(spec: JobSpec, job_dir: str) -> None:
    """A master still owning ``job_dir``'s journal means a job is running there: its
    files must not be wiped (JournalLockedError, a usage error)."""
    owner = JournalOwner(os.path.join(job_dir, LOCK_FILE))
    try:
        owner.acquire(0.0)
    except JournalLockedError as e:
        raise JournalLockedError(f"a job is already running in {job_dir} ({e}); stop it "
                                 f"(elasticdl stop {spec.job_name}) or give this run another "
                                 "--job_name or --output") from None
    finally:
        owner.release()


def run_local_cluster_job(spec: JobSpec, out: Any = None, timeout_s: Optional[float] = None
                          ) -> dict[str, Any]:
    """Start the master process, stream its log, wait; returns the job report.

    Ctrl-C, SIGTERM or SIGHUP (any KeyboardInterrupt; the CLI turns the signals into
    one) or ``timeout_s`` stops the master, which stops every replica; replicas
    still running after it are killed.
    """
    out = out or sys.stderr
    job_dir = register_job_dir(spec)
    _refuse_a_running_job(spec, job_dir)
    os.makedirs(os.path.join(job_dir, "logs"), exist_ok=True)
    for stale in (REPORT_NAME, STATE_FILE, RESTARTS_FILE, STOP_FILE, job_figures.METRICS_FILE):
        if os.path.exists(os.path.join(job_dir, stale)):
            os.unlink(os.path.join(job_dir, stale))
    shutil.rmtree(os.path.join(job_dir, JOURNAL_DIR), ignore_errors=True)
    with open(os.path.join(job_dir, "job_spec.json"), "w") as f:
        f.write(spec.to_json())
    # the job's token (and TLS cert), new per submission: 0600 files in the job dir and
    # the environment of the master, which passes it to every replica
    job_secrets = auth.generate(spec.grpc_tls)
    auth.write_job_secrets(job_dir, job_secrets)
    port = free_port()  # the master's port for the whole job: a relaunched master reuses it
    log_path = os.path.join(job_dir, "logs", "master.log")
    pos = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    cmd = [*entry_points.MASTER.argv(sys.executable), f"--job_spec={spec.to_json()}",
           f"--port={port}", f"--job_dir={job_dir}"]
    env = {**os.environ, **job_secrets.env(), "PYTHONUNBUFFERED": "1"}
    # replicas of a master that dies become ours: we reap them and tell the next
    # master their exit codes (it adopts them)
    subreaper = become_subreaper()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    restarts = 0
    proc: Optional[subprocess.Popen] = None
    try:
        with _signals_deferred():  # a signal lands after proc is known, never inside Popen
            proc = _start_master(cmd, log_path, env, job_dir, spec.job_name, port)
        out.write(f"job {spec.job_name}: master pid {proc.pid}, directory {job_dir}\n")
        while True:
            while proc.poll() is None:
                pos = _follow(log_path, pos, out)
                if subreaper and restarts:
                    reap_orphans(job_dir, [int(r["pid"]) for r in
                                           _load(job_dir, STATE_FILE).get("replicas", [])])
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {spec.job_name} ran past {timeout_s:.0f} s")
                time.sleep(0.2)
            pos = _follow(log_path, pos, out)
            if not _unfinished(job_dir) or restarts >= spec.max_master_restarts:
                break
            restarts += 1
            _note_restart(job_dir, proc.returncode)
            with _signals_deferred():
                proc = _start_master(cmd + ["--restore"], log_path, env, job_dir,
                                     spec.job_name, port)
            out.write(f"job {spec.job_name}: the master died (exit {_code(job_dir)}); "
                      f"relaunched it ({restarts}/{spec.max_master_restarts}), pid {proc.pid}\n")
    except (KeyboardInterrupt, TimeoutError):
        # Ctrl-C, SIGTERM, SIGHUP (elasticdl_client.main.Interrupted) or the timeout: the
        # master and replicas run in their own sessions, so stop them here. Stop first,
        # then write: after SIGHUP the terminal may be gone and writing raise EIO.
        _say(out, f"\nstopping job {spec.job_name} ...\n")
        if proc is not None:
            terminate(proc, grace_s=30)
        left = _kill_replicas(job_dir)  # a master that did not stop its replicas in time
        with contextlib.suppress(OSError):
            _follow(log_path, pos, out)
        if left:
            _say(out, f"job {spec.job_name}: killed replicas the master left: "
                 f"{', '.join(left)}\n")
        raise
    _follow(log_path, pos, out)
    report = read_job_report(job_dir)
    if report.get("status") in ("running", "starting") or not report.get("status"):
        report = _master_died(job_dir, proc.returncode, report)
    return report


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP until the block is done, then deliver them to
    the handlers they had. (Not with the signal mask: a child started under it would
    inherit it and never see SIGTERM.)"""
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    pending: list[int] = []
    old = {sig: signal.signal(sig, lambda signum, frame: pending.append(signum))
           for sig in held}
    try:
        yield
    finally:
        for sig, handler in old.items():
            if handler is not None:  # None: set outside Python; leave ours (records only)
                signal.signal(sig, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)


def _say(out: Any, text: str) -> None:
    with contextlib.suppress(OSError):  # a hung-up terminal
        out.write(text)
        out.flush()


def _start_master(cmd: list[str], log_path: str, env: dict[str, str], job_dir: str,
                  job_name: str, port: int) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    with open(os.path.join(job_dir, MASTER_FILE), "w") as f:
        json.dump({"pid": proc.pid, "port": port, "job_name": job_name}, f)
    return proc


def _unfinished(job_dir: str) -> bool:
    """The master exited but its job had not ended (killed, crashed)."""
    if os.path.exists(os.path.join(job_dir, STOP_FILE)):
        return False
    report = _load(job_dir, REPORT_NAME)
    return report.get("status") in (None, "running", "starting")


def _note_restart(job_dir: str, code: Optional[int]) -> None:
    """Tell the relaunched master why and when its predecessor died (the report's
    ``master_restarts``)."""
    notes = _load_list(job_dir, RESTARTS_FILE)
    reason = f"killed by signal {-code}" if code is not None and code < 0 else \
        f"exited with code {code}"
    notes.append({"died_at": time.time(), "exit_code": code, "reason": reason})
    tmp = os.path.join(job_dir, RESTARTS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(notes, f)
    os.replace(tmp, os.path.join(job_dir, RESTARTS_FILE))


def _code(job_dir: str) -> Any:
    notes = _load_list(job_dir, RESTARTS_FILE)
    return notes[-1]["exit_code"] if notes else None


def _load_list(job_dir: str, name: str) -> list[Any]:
    try:
        with open(os.path.join(job_dir, name)) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return []
    return value if isinstance(value, list) else []


def _master_died(job_dir: str, code: Optional[int], report: dict[str, Any]
                 ) -> dict[str, Any]:
    """The master exited without finishing the report (killed, or crashed
    before it could write it): stop whatever it left running and record the
    failure, so the report never stays ``running``."""
    killed = _kill_replicas(job_dir)
    error = f"the master exited with code {code} before the job ended"
    if killed:
        error += f"; stopped the replicas it left running: {', '.join(killed)}"
    report = dict(report)
    report["status"] = "failed"
    report["failure"] = report.get("failure") or {
        "replica": "master", "error": error + " (see logs/master.log)", "traceback": ""}
    tmp = os.path.join(job_dir, REPORT_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, os.path.join(job_dir, REPORT_NAME))
    return report


def _kill_replicas(job_dir: str) -> list[str]:
    """SIGKILL every replica ``replicas.json`` lists as running; their names."""
    killed = []
    for r in _load(job_dir, STATE_FILE).get("replicas", []):
        if _alive(int(r["pid"])):
            try:
                os.killpg(int(r["pid"]), signal.SIGKILL)
                killed.append(r["replica"])
            except ProcessLookupError:
                pass
    return killed


def read_job_report(job_dir: str) -> dict[str, Any]:
    path = os.path.join(job_dir, REPORT_NAME)
    if not os.path.exists(path):
        return {"status": "failed", "failure": {"replica": "master", "error":
                "the master wrote no job report; see logs/master.log"}}
    with open(path) as f:
        return json.load(f)


def find_job(job_name: str) -> str:
    path = named_job_dir(job_name)
    if not os.path.isdir(path):
        raise JobNotFound(f"no local job named {job_name!r} (looked in {path})")
    return os.path.realpath(path)


def _alive(pid: int) -> bool:
    """True if ``pid`` runs and is one of ours (guards against pid reuse)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    return b"elasticdl" in cmdline


def _load(job_dir: str, name: str) -> dict[str, Any]:
    try:
        with open(os.path.join(job_dir, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def status(job_name: str) -> str:
    """A human-readable status of a local job."""
    job_dir = find_job(job_name)
    master = _load(job_dir, MASTER_FILE)
    report = _load(job_dir, REPORT_NAME)
    replicas = _load(job_dir, STATE_FILE)
    running = bool(master) and _alive(int(master.get("pid", -1)))
    lines = [f"job {job_name}: {report.get('status', 'starting')} "
             f"(master {'running' if running else 'not running'}) in {job_dir}"]
    if report:
        ds = report.get("dataset", {})
        lines.append(f"  strategy {report.get('strategy')}, training records "
                     f"{ds.get('training_records')}, validation {ds.get('validation_records')}")
        source, figures = job_figures.figures(job_dir, report, running)
        lines.append(f"  figures {source}:")
        lines.extend(figures)
        if report.get("final_metrics"):
            lines.append(f"  final metrics: {report['final_metrics']}")
        for r in report.get("relaunches", []):
            lines.append(f"  relaunch: {r['replica']} -> {r['new_replica']} ({r['reason']}, "
                         f"exit {r['exit_code']})")
        if report.get("failure"):
            lines.append(f"  failure: {report['failure'].get('replica')}: "
                         f"{report['failure'].get('error')}")
    for r in replicas.get("replicas", []):
        lines.append(f"  {r['replica']:<12} running   pid {r['pid']}")
    for r in replicas.get("exited", [])[-20:]:
        lines.append(f"  {r['replica']:<12} {r['phase']:<9} exit {r['exit_code']} "
                     f"({r['reason']})")
    return "\n".join(lines)


def logs(job_name: str, replica: str = "master", follow: bool = False,
         out: Any = None) -> None:
    out = out or sys.stdout
    job_dir = find_job(job_name)
    path = os.path.join(job_dir, "logs", f"{replica}.log")
    if not os.path.exists(path):
        names = sorted(n[:-4] for n in os.listdir(os.path.join(job_dir, "logs"))
                       if n.endswith(".log"))
        raise JobNotFound(f"job {job_name} has no replica {replica!r}; replicas: "
                          f"{', '.join(names)}")
    pos = _follow(path, 0, out)
    master = _load(job_dir, MASTER_FILE)
    while follow and master and _alive(int(master["pid"])):
        time.sleep(0.5)
        pos = _follow(path, pos, out)
    _follow(path, pos, out)


def stop(job_name: str, grace_s: float = 30.0) -> str:
    """Stop a local job: the master tears its replicas down; stragglers are killed."""
    job_dir = find_job(job_name)
    master = _load(job_dir, MASTER_FILE)
    killed = []
    with open(os.path.join(job_dir, STOP_FILE), "w") as f:
        f.write(f"{time.time()}\n")
    pid = int(master.get("pid", -1))
    if pid > 0 and _alive(pid):
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
        killed.append("master")
    killed.extend(_kill_replicas(job_dir))
    return f"job {job_name}: stopped {', '.join(killed) or 'nothing (not running)'}"
