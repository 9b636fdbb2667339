"""benchmarks/scale_ps.py --smoke runs and its sizes stay flat: the PS ledger's live
entries, checkpoint and rollback answer, and the trained set's joiner payload do not
grow with the pushes (minibatches) the job made, while the old classes' do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_scale_ps_smoke_sizes_are_flat():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "scale_ps.py"),
                           "--smoke"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_growth_ratio"] > 0
    ps, trained = result["ps_ledger"], result["trained_set"]
    for key in ("live_entries", "checkpoint_bytes", "rollback_answer_bytes"):
        assert ps["growth"][key] <= 1.2, (key, ps["growth"])
    for key in ("live_entries", "join_bytes", "checkpoint_bytes"):
        assert trained["growth"][key] <= 1.2, (key, trained["growth"])
    small, large = ps["rows"][0], ps["rows"][-1]   # 10x the pushes
    assert large["baseline_ledger_bytes"] >= 9 * small["baseline_ledger_bytes"]
    small, large = trained["rows"][0], trained["rows"][-1]
    assert large["baseline_join_bytes"] >= 9 * small["baseline_join_bytes"]
