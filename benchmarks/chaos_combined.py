"""Combined-fault chaos campaign (issue 21): ``chaos_campaign.py --combined``.

Each trial runs the record-counting job (tests/fixtures/zoo/toy/count_records.py:
its parameters count how often each record was trained) through the real CLI
as a local-cluster job, PS (2 PS, 2 workers, async) or allreduce (2 workers),
with two or three faults drawn from {worker, PS, master, exporter}:

* PS: the PS SIGKILLs itself after a random number of its versions
  (``ps-I:after_version@N``, fault points: ``elasticdl/common/faults.py``);
* master: with a PS fault, at a random step of the PS rollback it causes
  (``after_ps_launched``, ``after_rollback_start``, ``after_ps_rollback``,
  ``after_requeue``) or, with a worker fault, between the relaunch's journaled
  id and its launch or snapshot; else kill -9 at a random point of training;
* worker: kill -9 of a random live worker at a random point of training;
* exporter: the worker exporting the final model SIGKILLs itself before
  writing it or after writing it and before reporting it.

"Random point of training": the job's newest complete checkpoint reaches a
random fraction of the versions the job makes. Each finished job is then
resumed once, from a random complete checkpoint of it, into a fresh directory.

A trial passes when both runs succeed and both exported models hold every
record exactly ``epochs`` times, or a run failed naming an exhausted documented
budget (master restarts, PS relaunches, task retries, the rollback or export
budget). A run still going after ``--timeout_s`` is a hang: the trial fails.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.integration.helpers import kill_job_tree, live_replicas, read_json  # noqa: E402

ZOO = os.path.join(ROOT, "tests", "fixtures", "zoo")
MINIBATCH = 8
BUDGET_WORDS = ("budget", "restarts", "failed", "times", "retries")
ROLLBACK_POINTS = ("after_ps_launched", "after_rollback_start", "after_ps_rollback",
                   "after_requeue")


def versions_per_run(mode: str, records: int, epochs: int) -> int:
    steps = records // MINIBATCH * epochs
    return steps if mode == "ps" else steps // 2   # allreduce: 2 members, one step each


def plan(mode: str, rng: random.Random, records: int, epochs: int, n_faults: int = 0
         ) -> dict[str, Any]:
    """The faults of one trial: fault points (env) and external kills (at fractions)."""
    kinds = ["worker", "ps", "master", "exporter"] if mode == "ps" else \
        ["worker", "master", "exporter"]
    chosen = rng.sample(kinds, n_faults or rng.choice([2, 3]))
    total = versions_per_run(mode, records, epochs)
    points: list[str] = []
    kills: list[tuple[str, float]] = []
    if "ps" in chosen:
        points.append(f"ps-{rng.randrange(2)}:after_version@{rng.randint(8, int(total * .8))}")
    if "worker" in chosen:
        kills.append(("worker", rng.uniform(0.1, 0.85)))
    if "master" in chosen:
        if "ps" in chosen and rng.random() < 0.75:
            points.append(f"master:{rng.choice(ROLLBACK_POINTS)}")
        elif "worker" in chosen and rng.random() < 0.5:
            points.append(f"master:{rng.choice(['after_launch_intent', 'after_relaunch'])}")
        else:
            kills.append(("master", rng.uniform(0.1, 0.85)))
    if "exporter" in chosen:
        points.append(f"exporter:{rng.choice(['before_export', 'after_export'])}")
    return {"faults": sorted(chosen), "points": points, "kills": sorted(kills,
                                                                         key=lambda k: k[1])}


def job_flags(mode: str, epochs: int) -> dict[str, Any]:
    common = {"model_zoo": ZOO, "model_def": "toy.count_records.custom_model",
              "minibatch_size": MINIBATCH, "num_minibatches_per_task": 4,
              "num_epochs": epochs, "shuffle": "true", "cluster": "local",
              "checkpoint_steps": 5, "keep_checkpoint_max": 1000,
              "master_reconnect_timeout_s": 90}
    if mode == "ps":
        return {**common, "distribution_strategy": "ParameterServerStrategy",
                "num_workers": 2, "num_ps_pods": 2}
    return {**common, "distribution_strategy": "AllreduceStrategy", "num_workers": 2,
            "collective_timeout_s": 10}


def newest_version(ckpt: str) -> int:
    from elasticdl.checkpoint.paths import complete_versions

    versions = complete_versions(ckpt)
    return versions[-1] if versions else -1


def run_job(name: str, work: str, data: str, flags: dict[str, Any], points: list[str],
            kills: list[tuple[str, float]], total: int, timeout_s: float,
            rng: random.Random, delay_s: float) -> dict[str, Any]:
    from elasticdl.common import faults

    job_dir = os.path.join(work, name)
    env = {**os.environ, "ELASTICDL_HOME": os.path.join(work, "home"),
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT, "COUNT_RECORDS": str(records_of(data)),
           "COUNT_RECORDS_DELAY_S": str(delay_s), faults.POINTS_ENV: ",".join(points),
           faults.DIR_ENV: os.path.join(work, name + "-faults")}
    args = {**flags, "training_data": data, "output": job_dir, "job_name": name}
    log_path = os.path.join(work, name + ".log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "elasticdl_client.main", "train",
                                 *[f"--{k}={v}" for k, v in args.items()]],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    out: dict[str, Any] = {"name": name, "killed": []}
    deadline = time.monotonic() + timeout_s
    ckpt = flags.get("checkpoint_dir", "")
    try:
        pending = list(kills)
        while proc.poll() is None and time.monotonic() < deadline:
            if pending and newest_version(ckpt) >= pending[0][1] * total:
                kind, _ = pending.pop(0)
                out["killed"].append(_kill(kind, job_dir, rng))
            time.sleep(0.1)
        code = proc.poll()
        out["hang"] = code is None
        out["exit_code"] = code
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json")) or {}
    out.update(status=report.get("status"), failure=(report.get("failure") or {}).get("error"),
               master_restarts=len(report.get("master_restarts", [])),
               rollbacks=len(report.get("ps_rollbacks", [])),
               relaunches=len(report.get("relaunches", [])),
               fired=faults.fired(env[faults.DIR_ENV]))
    out["exact"] = exact(os.path.join(job_dir, "model.pt"), flags["num_epochs"])
    if out["status"] != "succeeded" or not out["exact"]:
        out["log_tail"] = open(log_path, errors="replace").read()[-1500:]
    return out


def _kill(kind: str, job_dir: str, rng: random.Random) -> Optional[str]:
    if kind == "master":
        pid = (read_json(os.path.join(job_dir, "master.json")) or {}).get("pid")
        victim = "master"
    else:
        live = [r for r in live_replicas(job_dir) if r["replica"].startswith("worker-")]
        if not live:
            return None
        r = rng.choice(live)
        pid, victim = r["pid"], r["replica"]
    try:
        os.kill(int(pid), signal.SIGKILL)
    except (ProcessLookupError, TypeError, ValueError):
        return None
    return victim


def exact(model_path: str, epochs: int) -> Optional[bool]:
    """Every record trained exactly ``epochs`` times in the exported model (None: no model)."""
    if not os.path.exists(model_path):
        return None
    import torch

    state = torch.load(model_path, weights_only=True)
    return all(bool((state[n] == epochs).all()) for n in ("even", "odd"))


def records_of(data: str) -> int:
    import numpy as np

    return int(np.load(os.path.join(data, "ids.npy"), mmap_mode="r").shape[0])


def judge(run: dict[str, Any]) -> str:
    """ok | budget (failed naming an exhausted documented budget) | hang | wrong."""
    if run["hang"]:
        return "hang"
    if run["status"] == "succeeded" and run["exact"]:
        return "ok"
    failure = (run.get("failure") or "").lower()
    if run["status"] == "failed" and any(w in failure for w in BUDGET_WORDS):
        return "budget"
    return "wrong"


def run_trial(mode: str, i: int, work: str, data: str, rng: random.Random, epochs: int,
              timeout_s: float, delay_s: float, n_faults: int = 0) -> dict[str, Any]:
    records = records_of(data)
    p = plan(mode, rng, records, epochs, n_faults)
    total = versions_per_run(mode, records, epochs)
    name = f"comb-{mode}-{i}"
    flags = {**job_flags(mode, epochs), "checkpoint_dir": os.path.join(work, name + "-ckpt")}
    t0 = time.monotonic()
    first = run_job(name, work, data, flags, p["points"], p["kills"], total, timeout_s, rng,
                    delay_s)
    result: dict[str, Any] = {"mode": mode, "trial": i, **p, "run": first}
    from elasticdl.checkpoint.paths import complete_versions

    versions = complete_versions(flags["checkpoint_dir"])
    if judge(first) == "ok" and len(versions) > 1:
        v = rng.choice(versions[:-1])
        resume = {**job_flags(mode, epochs), "checkpoint_dir": os.path.join(work, name + "-r"),
                  "checkpoint_dir_for_init": os.path.join(flags["checkpoint_dir"],
                                                          f"version-{v}")}
        result["resumed_from"] = v
        result["resume"] = run_job(name + "-r", work, data, resume, [], [], total, timeout_s,
                                   rng, 0.0)
    verdicts = [judge(first)] + ([judge(result["resume"])] if "resume" in result else [])
    result["verdict"] = "hang" if "hang" in verdicts else "wrong" if "wrong" in verdicts else \
        "budget" if "budget" in verdicts else "ok"
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return result


def campaign(ps_trials: int, allreduce_trials: int, seed: int, epochs: int, records: int,
             timeout_s: float, delay_s: float, output: str, n_faults: int = 0) -> int:
    import tempfile

    import numpy as np

    rng = random.Random(seed)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="chaos-combined-") as work:
        data = os.path.join(work, "ids")
        os.makedirs(data)
        np.save(os.path.join(data, "ids.npy"), np.arange(records, dtype=np.int64))
        for mode, n in (("ps", ps_trials), ("allreduce", allreduce_trials)):
            for i in range(n):
                r = run_trial(mode, i, work, data, rng, epochs, timeout_s, delay_s, n_faults)
                results.append(r)
                runs = [r["run"]] + ([r["resume"]] if "resume" in r else [])
                print(f"{mode:9s} trial {i:2d}: {r['verdict'].upper():6s} faults "
                      f"{'+'.join(r['faults'])} points {r['points']} killed "
                      f"{r['run']['killed']} fired {r['run']['fired']} restarts "
                      f"{r['run']['master_restarts']} rollbacks {r['run']['rollbacks']} "
                      f"resumed from {r.get('resumed_from')} ({r['wall_s']} s)"
                      + "".join(f" [{x['name']}: {x['status']} exact={x['exact']} "
                                f"{x.get('failure') or ''}]" for x in runs
                                if judge(x) != "ok"), flush=True)
    summary: dict[str, Any] = {}
    for mode in ("ps", "allreduce"):
        mine = [r for r in results if r["mode"] == mode]
        if mine:
            summary[mode] = {v: sum(r["verdict"] == v for r in mine)
                             for v in ("ok", "budget", "wrong", "hang")}
            summary[mode]["trials"] = len(mine)
            summary[mode]["wall_s_median"] = sorted(r["wall_s"] for r in mine)[len(mine) // 2]
    print(json.dumps(summary), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
        json.dump({"summary": summary, "trials": results}, f, indent=1)
    return 0 if all(r["verdict"] in ("ok", "budget") for r in results) else 1
