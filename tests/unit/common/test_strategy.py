"""The strategy registry: what each strategy launches, needs and runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elasticdl.common.enums import Strategy
from elasticdl.common.job_spec import JobSpecError, job_spec_from_flags
from elasticdl.common.strategy import entry_for
from tests.conftest import ROOT


def spec(job_type="train", **flags):
    base = {"model_zoo": "zoo", "model_def": "m.custom_model", "training_data": "t",
            "validation_data": "v", "checkpoint_dir_for_init": "c", "output": "o",
            "prediction_data": "p", "num_ps_pods": 3}
    if job_type == "train":
        base.pop("checkpoint_dir_for_init")
    return job_spec_from_flags(job_type, {**base, **flags})


def test_every_strategy_is_registered():
    assert {entry_for(s).strategy for s in Strategy} == set(Strategy)
    assert entry_for("ParameterServerStrategy") is entry_for(Strategy.PS)
    with pytest.raises(ValueError):
        entry_for("Horovod")


@pytest.mark.parametrize("name,job_type,ps,rdzv", [
    ("ParameterServerStrategy", "train", 3, False),
    ("ParameterServerStrategy", "evaluate", 0, False),
    ("AllreduceStrategy", "train", 0, True),
    ("AllreduceStrategy", "predict", 0, False),
    ("Local", "train", 0, False),
])
def test_replicas_and_rendezvous(name, job_type, ps, rdzv):
    s = spec(job_type, distribution_strategy=name, num_workers=1)
    e = entry_for(s.distribution_strategy)
    assert e.ps_to_launch(s) == ps
    assert e.rendezvous_needed(s) is rdzv
    # the report lists the configured PS of a PS job whatever its type
    assert e.num_ps(s) == (3 if name == "ParameterServerStrategy" else 0)


def test_the_registry_names_no_worker_code():
    # the worker package registers each strategy's runtime by class
    # (elasticdl.worker.runtime.runtime_class, tests/unit/worker/test_worker_runtime.py)
    for s in Strategy:
        assert not hasattr(entry_for(s), "runtime")


def test_job_spec_rules_come_from_the_registry():
    with pytest.raises(JobSpecError, match="num_workers"):
        spec(distribution_strategy="Local", num_workers=2)
    with pytest.raises(JobSpecError, match="use_async"):
        spec(distribution_strategy="AllreduceStrategy", use_async=True)
    assert spec(distribution_strategy="ParameterServerStrategy", use_async=True).use_async


def test_registry_never_imports_torch():
    code = ("import sys\nfrom elasticdl.common.strategy import entry_for\n"
            "from elasticdl.common.enums import Strategy\n"
            "[entry_for(s).rendezvous_needed for s in (Strategy.PS, Strategy.ALLREDUCE)]\n"
            "sys.exit(1 if 'torch' in sys.modules else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
