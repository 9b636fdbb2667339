"""Real parameter-server processes on 127.0.0.1 for integration tests and benchmarks."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Optional

from elasticdl.common.job_spec import JobSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class PSProcess:
    """``python -m elasticdl.ps.main`` as a child process.

    ``port=0`` lets the PS pick a free port; it is read from the
    "PS i serving on port P" line the process prints.
    """

    def __init__(self, ps_id: int, num_ps: int, job: JobSpec, port: int = 0,
                 log_path: Optional[str] = None, timeout_s: float = 60.0,
                 extra: Sequence[str] = ()):
        self.ps_id = ps_id
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elasticdl.ps.main", f"--ps_id={ps_id}",
             f"--num_ps={num_ps}", f"--port={port}", f"--job_spec={job.to_json()}",
             "--host=127.0.0.1", *extra],
            stdout=subprocess.PIPE, stderr=self._log, cwd=ROOT, env=env,
            start_new_session=True)
        self.port = self._wait_port(timeout_s)
        self.addr = f"127.0.0.1:{self.port}"

    def _wait_port(self, timeout_s: float) -> int:
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        buf = b""
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"PS {self.ps_id} exited with {self.proc.returncode}")
                if not sel.select(timeout=0.2):
                    continue
                data = os.read(self.proc.stdout.fileno(), 4096)
                buf += data
                m = re.search(rb"PS \d+ serving on port (\d+)", buf)
                if m:
                    return int(m.group(1))
        finally:
            sel.close()
        self.kill()
        raise TimeoutError(f"PS {self.ps_id} did not start within {timeout_s:.0f} s")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the process group and reap it (bounded wait)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def terminate(self) -> int:
        """SIGTERM (graceful stop); returns the exit code."""
        self.kill(signal.SIGTERM)
        return self.proc.returncode


def run_in_threads(fns: list[Callable[[], None]], timeout_s: float) -> None:
    """Run each function in its own thread (one per worker); re-raise the first error."""
    errors: list[BaseException] = []

    def guarded(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by the calling thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "workers did not finish"
    if errors:
        raise errors[0]
