"""``elasticdl scale``: bad input is refused with a clear message and exit code 2."""

from __future__ import annotations

import subprocess
import sys

from elasticdl_client.scale import scale
from tests.conftest import ROOT


def test_bad_sizes_and_unknown_jobs_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ELASTICDL_HOME", str(tmp_path))
    assert scale("job", None) == 2
    assert "--num_workers=N or --num_workers=MIN:MAX is required" in capsys.readouterr().err
    assert scale("job", "4:2") == 2
    assert "--num_workers: expects N or MIN:MAX" in capsys.readouterr().err
    assert scale("nojob", "2", cluster="local") == 2
    assert "no local job named 'nojob'" in capsys.readouterr().err


def test_cli_scale_of_an_unknown_local_job(tmp_path):
    out = subprocess.run([sys.executable, "-m", "elasticdl_client.main", "scale", "nojob",
                          "--num_workers=1:2", "--cluster=local"], cwd=ROOT,
                         env={"ELASTICDL_HOME": str(tmp_path), "PYTHONPATH": ROOT,
                              "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no local job named 'nojob'" in out.stderr
