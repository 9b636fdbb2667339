"""The master never imports torch (built-in readers): a subprocess imports the
master's entry point, builds the task manager over real data files, serves the
Master service and creates the rendezvous, then checks ``sys.modules``."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = r'''
import os, sys, tempfile
import numpy as np
import elasticdl.master.main as m
from elasticdl.common.job_spec import job_spec_from_flags
from elasticdl.master.servicer import MasterServicer, start_master_server

d = tempfile.mkdtemp()
os.makedirs(f"{d}/train"); os.makedirs(f"{d}/val")
np.savez(f"{d}/train/a.npz", x=np.zeros((40, 3), np.float32), y=np.zeros(40, np.int64))
with open(f"{d}/val/a.csv", "w") as f:
    f.write("".join(f"{i},1.0\n" for i in range(30)))
spec = job_spec_from_flags("train", {"model_zoo": d, "model_def": "nope.custom_model",
    "training_data": f"{d}/train", "validation_data": f"{d}/val", "num_workers": 2,
    "distribution_strategy": "AllreduceStrategy", "evaluation_steps": 5})
core = m.build_core(spec)
tm = core.tm
assert tm.training_records == 40 and tm.evaluation_records == 30, tm.training_records
rdzv = m._rendezvous(spec, "127.0.0.1")
server = start_master_server(MasterServicer(core, rdzv), 0)
server.stop(0)
heavy = sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "numpy.testing"))
print("IMPORTED:", heavy)
sys.exit(1 if any(n.split(".")[0] == "torch" for n in heavy) else 0)
'''


def test_master_never_imports_torch():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
