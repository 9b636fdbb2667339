"""Faults in combination, deterministically: a counting job through the real CLI
whose processes SIGKILL themselves at named points of the recovery protocols
(``ELASTICDL_FAULT_POINTS``, :mod:`elasticdl.common.faults`), then the exported
model itself says how often each record was trained (the record-counting
fixture, tests/fixtures/zoo/toy/count_records.py)."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from elasticdl.common import faults
from tests.conftest import FIXTURE_ZOO, ID_RECORDS
from tests.integration.helpers import kill_job_tree, read_json, start_cli

RECORDS = ID_RECORDS
MINIBATCH = 8


def count_args(data: str, out: str, job: str, epochs: int,
               model_def: str = "toy.count_records.custom_model", **flags: Any) -> list[str]:
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", f"--model_def={model_def}",
            f"--training_data={data}", f"--output={out}", f"--job_name={job}",
            "--cluster=local", f"--minibatch_size={MINIBATCH}", "--num_minibatches_per_task=4",
            f"--num_epochs={epochs}", "--shuffle"]
    return args + [f"--{k}={v}" for k, v in flags.items()]


PS_FLAGS = {"distribution_strategy": "ParameterServerStrategy", "num_workers": 2,
            "num_ps_pods": 2, "checkpoint_steps": 5, "keep_checkpoint_max": 50,
            "master_reconnect_timeout_s": 90}


def run_job(tmp_path, data: str, name: str, points: str, epochs: int = 2,
            delay_s: float = 0.02, timeout_s: float = 420,
            during: Optional[Callable[[Any, str], None]] = None,
            env: Optional[dict[str, str]] = None, **flags: Any) -> dict[str, Any]:
    """Run a counting job with fault ``points`` (``env``: more variables for every
    process); returns {"code", "report", "state", "fired", "log", "job_dir"}
    (``state``: the exported model, or None)."""
    job_dir = str(tmp_path / name)
    fault_dir = str(tmp_path / f"{name}-faults")
    log_path = str(tmp_path / f"{name}.log")
    env = {"COUNT_RECORDS": str(RECORDS), "COUNT_RECORDS_DELAY_S": str(delay_s),
           faults.POINTS_ENV: points, faults.DIR_ENV: fault_dir, **(env or {})}
    proc = start_cli(count_args(data, job_dir, name, epochs, **flags),
                     str(tmp_path / "home"), log_path, **env)
    try:
        if during is not None:
            during(proc, job_dir)
        code = proc.wait(timeout=timeout_s)
    finally:
        kill_job_tree(proc, job_dir)
    model = os.path.join(job_dir, "model.pt")
    return {"code": code, "report": read_json(os.path.join(job_dir, "job_report.json")) or {},
            "state": torch.load(model, weights_only=True) if os.path.exists(model) else None,
            "fired": faults.fired(fault_dir), "log": open(log_path, errors="replace").read(),
            "job_dir": job_dir}


def logs_of(job_dir: str, prefix: str = "") -> str:
    logs = os.path.join(job_dir, "logs")
    return "".join(open(os.path.join(logs, n), errors="replace").read()
                   for n in sorted(os.listdir(logs)) if n.startswith(prefix))


def assert_trained_exactly(run: dict[str, Any], epochs: int, fired: tuple[str, ...] = ()
                           ) -> dict[str, Any]:
    """The job succeeded, each named fault point fired, and every record was trained
    exactly ``epochs`` times in the exported model."""
    tail = run["log"][-4000:]
    for entry in fired:
        assert entry in run["fired"], (entry, run["fired"], tail)
    report = run["report"]
    assert run["code"] == 0 and report.get("status") == "succeeded", (
        report.get("failure"), tail)
    state = run["state"]
    assert state is not None, "no model.pt"
    for name in ("even", "odd"):
        counts = state[name]
        wrong = (counts != epochs).nonzero().flatten().tolist()
        assert not wrong, (f"{name}: records trained != {epochs} times: "
                           f"{[(i, counts[i].item()) for i in wrong[:20]]} ({len(wrong)} in all)")
    return report


def ps_recoveries(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's PS recoveries of either mode: lone restores (``ps_recoveries``,
    ``--ps_recovery=alone``) and rollbacks of every PS (``ps_rollbacks``)."""
    return list(report.get("ps_recoveries", [])) + list(report.get("ps_rollbacks", []))


def counts_of(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return state["even"] + state["odd"]


EPOCHS = 2


def ps_job(tmp_path, data, name, points, **flags):
    """A counting PS job of ``EPOCHS`` epochs with a checkpoint directory of its own."""
    return run_job(tmp_path, data, name, points, epochs=EPOCHS,
                   checkpoint_dir=str(tmp_path / f"{name}-ckpt"), **{**PS_FLAGS, **flags})


def worker_processes(job_dir):
    """Every pid each worker name ran under (live and exited), from replicas.json."""
    state = read_json(f"{job_dir}/replicas.json") or {}
    seen: dict[str, set] = {}
    for r in state.get("replicas", []) + state.get("exited", []):
        seen.setdefault(r["replica"], set()).add(r["pid"])
    return seen
