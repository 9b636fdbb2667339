"""Running the `elasticdl` CLI as a real process in tests, and cleaning up after it."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Optional

from tests.conftest import ROOT


def cli_env(home: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"ELASTICDL_HOME": home, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT})
    env.update(extra)
    return env


# Ctrl-C in a terminal reaches a foreground job whose SIGINT is at its default. A test
# run started in the background (`make test &`, nohup) has SIGINT ignored, every child
# inherits that, exec keeps it, and Python then never raises KeyboardInterrupt: the
# launcher puts the default back before it execs the CLI.
_AS_FROM_A_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                       "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")


def start_cli(args: list[str], home: str, log_path: str, *, terminal: bool = False,
              **env: str) -> subprocess.Popen:
    """The CLI as its own process group; ``terminal``: with SIGINT at its default, as a
    terminal's foreground job has it, whatever this test run inherited."""
    log = open(log_path, "wb")
    launcher = [sys.executable, "-c", _AS_FROM_A_TERMINAL] if terminal else [sys.executable]
    return subprocess.Popen([*launcher, "-m", "elasticdl_client.main", *args],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=cli_env(home, **env), start_new_session=True)


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def journal_records(job_dir: str, after_seq: int = 0) -> list[dict]:
    """The master's journal records after ``after_seq``, read from outside while it
    writes: a line cut short is skipped, a segment a snapshot removed meanwhile too."""
    out = []
    for path in glob.glob(os.path.join(job_dir, "journal", "journal-*.jsonl")):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            continue
        for line in text.split("\n"):
            if line.endswith("}"):
                rec = json.loads(line)
                if rec["seq"] > after_seq:
                    out.append(rec)
    return out


def task_events(job_dir: str, after_seq: int = 0) -> list[dict]:
    """:func:`journal_records` with a lease's hand-outs and a batch's results
    spelled out one task each, as ``{"op": "get", "seq", "w", "task": [...]}`` and
    ``{"op": "report", "seq", "w", "task": id, "ok"}`` (the other records as they are)."""
    out = []
    for r in journal_records(job_dir, after_seq):
        if r["op"] == "lease":
            out += [{"op": "get", "seq": r["seq"], "w": r["w"], "task": t} for t in r["tasks"]]
        elif r["op"] == "reports":
            out += [{"op": "report", "seq": r["seq"], "w": r["w"], "task": x[0], "ok": x[1]}
                    for x in r["results"]]
        else:
            out.append(r)
    return out


def read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def pid_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except OSError:
        return False


def live_replicas(job_dir: str) -> list[dict]:
    state = read_json(os.path.join(job_dir, "replicas.json")) or {}
    return state.get("replicas", [])


def pid_of(job_dir: str, replica: str) -> Optional[int]:
    """The pid of a live replica of a local job (``worker-1``, ``ps-0``), or None."""
    return next((r["pid"] for r in live_replicas(job_dir) if r["replica"] == replica), None)


def records_done(job_dir: str) -> int:
    """Training records completed so far, from the job report (written every few s)."""
    report = read_json(os.path.join(job_dir, "job_report.json")) or {}
    return sum(e["records_completed"] for e in report.get("epochs", []))


def kill_job_tree(proc: subprocess.Popen, job_dir: str) -> None:
    """Stop the CLI, its master and every replica, whatever state they are in."""
    for pid in [proc.pid] + [r["pid"] for r in live_replicas(job_dir)] + [
            (read_json(os.path.join(job_dir, "master.json")) or {}).get("pid", -1)]:
        if pid and pid > 0:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
