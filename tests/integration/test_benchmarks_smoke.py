"""Every script in benchmarks/ runs in its ``--smoke`` mode (seconds, tiny sizes), so
none can rot unseen: exit 0 and a sane figure on stdout.

The scripts (files that run as ``__main__``) are found by glob, so a new benchmark
is covered the day it lands; one without ``--smoke`` fails here by name. They run as
real processes (most start PS, workers or gloo ranks of their own), a few at a
time: on a loaded 2-core machine most of a smoke run is waiting for ``import torch``
in its processes, so running them side by side costs about the slowest few, not
the sum.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def _is_script(path: str) -> bool:
    """A benchmark script runs as ``__main__``; a module only the scripts import
    (e.g. chaos_combined.py, behind ``chaos_campaign.py --combined``) is not one."""
    with open(path, encoding="utf-8") as f:
        return "__name__ == \"__main__\"" in f.read()


# scripts whose smoke another test runs (where it needs what that test already has up)
SMOKED_ELSEWHERE = {
    # its smoke pair on the real-cluster tier's control plane (tests/k8s/test_elastic_real.py::
    # test_elastic_scheduling_benchmark_smoke, ~60 s); here it would start a plane of its
    # own, ~230 s of this module's wall time on a loaded machine
    "elastic_scheduling.py": "tests/k8s/test_elastic_real.py",
}
BENCHMARKS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "benchmarks",
                                                                         "*.py"))
                    if _is_script(p) and os.path.basename(p) not in SMOKED_ELSEWHERE)
TIMEOUT_S = 420.0          # per script: whole jobs (master, PS, workers) on a loaded machine
# the slowest smokes first (ctr_models' four jobs are the longest: 271 s of a loaded CI
# run, which started it late and ended the file on it)
SLOW_FIRST = ("ctr_models.py", "chaos_campaign.py", "object_storage.py", "master_failover.py",
              "allreduce_recovery.py",
              "end_to_end.py", "training_features.py", "ps_step.py", "fuzz_rpc.py")
PARALLEL = 4
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def run_smoke(script: str) -> dict[str, Any]:
    """``python benchmarks/<script> --smoke`` in its own session (whatever it starts is
    killed with it on a timeout); its exit code, output, wall and CPU seconds."""
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, os.path.join("benchmarks", script),
                                 "--smoke"], cwd=ROOT, env=env, stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        killer = threading.Timer(TIMEOUT_S, os.killpg, (proc.pid, signal.SIGKILL))
        killer.start()
        try:
            # wait4: the CPU time of the script and of the processes it waited for
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            killer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {"rc": proc.returncode, "stdout": out.read(), "stderr": err.read(),
                "timed_out": proc.returncode == -signal.SIGKILL,
                "wall_s": time.monotonic() - start,
                "cpu_s": usage.ru_utime + usage.ru_stime}


@pytest.fixture(scope="module")
def smoke_runs(request):
    """Every selected script's smoke run, started at once, PARALLEL at a time, the
    slow ones first."""
    # test_benchmark_smoke's scripts only (not those SMOKED_ELSEWHERE, whose check is
    # parametrized by script too: they ran here, a control plane and ~190 s, for nothing)
    selected = [item.callspec.params["script"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")
                and getattr(item, "originalname", "") == "test_benchmark_smoke"]
    order = sorted(set(selected), key=lambda s: (s not in SLOW_FIRST,
                                                 SLOW_FIRST.index(s) if s in SLOW_FIRST else 0,
                                                 s))
    pool = ThreadPoolExecutor(PARALLEL)
    start = time.monotonic()
    futures: dict[str, Future] = {s: pool.submit(run_smoke, s) for s in order
                                  if has_smoke(s)}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)
    done = {s: f.result() for s, f in futures.items() if f.done() and not f.cancelled()}
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if done and capman is not None:  # past pytest's capture: the suite's cost
        with capman.global_and_fixture_disabled():
            sys.stderr.write(f"\nbenchmarks --smoke: {len(done)} scripts in "
                             f"{time.monotonic() - start:.0f} s wall, "
                             f"{sum(r['cpu_s'] for r in done.values()):.0f} s CPU; each "
                             "(wall s / CPU s): " + ", ".join(
                                 f"{s} {r['wall_s']:.0f}/{r['cpu_s']:.0f}"
                                 for s, r in sorted(done.items())) + "\n")


def has_smoke(script: str) -> bool:
    with open(os.path.join(ROOT, "benchmarks", script)) as f:
        return "--smoke" in f.read()


def sane_figures(stdout: str) -> list[str]:
    """The problems with a smoke run's output (empty: sane): some figure printed,
    JSON lines parse and hold finite numbers, no NaN anywhere."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return ["printed nothing"]
    problems = []
    if not NUMBER.search(stdout):
        problems.append("printed no figure")
    if re.search(r"\bnan\b", stdout, re.IGNORECASE):
        problems.append("printed NaN")
    text = stdout.strip()
    blobs = [line.strip() for line in lines if line.lstrip().startswith("{")]
    if text.startswith("{") and text.endswith("}"):
        blobs = [text]  # one indented JSON document
    for blob in blobs:
        try:
            value = json.loads(blob)
        except ValueError:
            if blob.endswith("}"):
                problems.append(f"a JSON line does not parse: {blob[:200]}")
            continue
        for leaf in _leaves(value):
            if isinstance(leaf, float) and not math.isfinite(leaf):
                problems.append(f"a JSON figure is {leaf}: {blob[:200]}")
    return problems


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)]
    return [value]


def test_benchmarks_are_found():
    assert len(BENCHMARKS) >= 15, BENCHMARKS


@pytest.mark.parametrize("script", sorted(SMOKED_ELSEWHERE))
def test_benchmarks_smoked_elsewhere_are(script):
    """A script left out here has its ``--smoke`` run by the test named for it."""
    assert has_smoke(script), script
    with open(os.path.join(ROOT, SMOKED_ELSEWHERE[script]), encoding="utf-8") as f:
        text = f.read()
    assert os.path.splitext(script)[0] in text and '"--smoke"' in text, script


@pytest.mark.parametrize("script", BENCHMARKS)
def test_benchmark_smoke(smoke_runs, script):
    assert has_smoke(script), f"benchmarks/{script} has no --smoke mode (every benchmark " \
        "needs one: seconds, tiny sizes, run by this test)"
    run = smoke_runs[script].result(timeout=TIMEOUT_S * len(smoke_runs))
    where = f"benchmarks/{script} --smoke ({run['wall_s']:.0f} s)"
    tail = f"\nstdout:\n{run['stdout'][-2000:]}\nstderr:\n{run['stderr'][-3000:]}"
    assert not run["timed_out"], f"{where} ran past {TIMEOUT_S:.0f} s{tail}"
    assert run["rc"] == 0, f"{where} exited {run['rc']}{tail}"
    problems = sane_figures(run["stdout"])
    assert not problems, f"{where}: {'; '.join(problems)}{tail}"


def test_sane_figures_rejects_what_it_should():
    assert sane_figures("median: 1.25 ms\n") == []
    assert sane_figures('{"a": 1, "b": [2.5]}\n') == []
    assert sane_figures("") == ["printed nothing"]
    assert "printed no figure" in sane_figures("done\n")
    assert any("NaN" in p for p in sane_figures("ratio nan x\n"))
    assert any("does not parse" in p for p in sane_figures('x 1\n{"a": 1,}\n'))
    assert sane_figures("[ps] median 1.5 ms; lr {0.0: 1.0}\n") == []
