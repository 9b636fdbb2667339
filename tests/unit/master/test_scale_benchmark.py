"""benchmarks/scale.py --smoke: the real core, servicer handlers and journal at two
sizes 10x apart; the snapshot's size must not grow with the tasks done and the
restored core must equal the live one (the benchmark exits non-zero otherwise); its
gRPC dispatch step runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def test_scale_benchmark_smoke():
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "scale.py"),
                           "--smoke"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("max_growth_ratio", "snapshot_lock_ms", "master_rss_mib", "restore_s",
                "dispatch_tasks_per_s", "dispatch_p99_ms"):
        assert key in result, result
    assert result["dispatch_tasks_per_s"] > 0   # the gRPC dispatch step ran
    rows = result["sections"]["core"]["rows"]
    small, large = rows[str(min(result["sizes"]))], rows[str(max(result["sizes"]))]
    assert large["tasks_done"] == 10 * small["tasks_done"]
    assert large["snapshot_bytes"] < 1.3 * small["snapshot_bytes"], rows
    assert large["closed_intervals"] <= 50 and large["unsettled"] <= 2 * 500
