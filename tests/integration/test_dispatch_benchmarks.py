"""The dispatch benchmarks' --smoke modes run and end with their JSON line, and
run_dispatch (imported by benchmarks/scale.py) measures a real master."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def smoke(script: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [ROOT, os.path.join(ROOT, "benchmarks"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--smoke"],
                         capture_output=True, text=True, timeout=600, env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_master_dispatch_smoke():
    got = smoke("master_dispatch.py")
    assert got["dispatch_tasks_per_s"] > 0 and got["dispatch_p99_ms"] > 0
    assert got["journal"] and got["metrics"]
    assert got["lease"]["tasks_per_s"] > 0 and got["single"]["tasks_per_s"] > 0


def test_observability_overhead_smoke():
    got = smoke("observability_overhead.py")
    assert got["without"] > 0 and got["with"] > 0


def test_run_dispatch_measures_a_real_master(monkeypatch):
    bench = os.path.join(ROOT, "benchmarks")
    # the spawned client processes import the benchmark by name too
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, bench,
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(bench)
    from master_dispatch import run_dispatch

    got = run_dispatch(20, 1.0, journal=True, metrics=True, task_ms=50.0, procs=1)
    assert got["tasks_per_s"] > 0 and got["calls"] > 0 and got["p99_ms"] >= got["p50_ms"]
