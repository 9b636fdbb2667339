"""Issue 10 consistency: a 3-worker allreduce job (real CLI, master and processes)
with a BatchNorm model and a clipping step function; one member is SIGKILLed mid-run
and relaunched. Every member hashes every parameter and buffer at the end of every
step (``tests/fixtures/zoo/toy/bn_digits.py``); members of the same plan must hold
bitwise identical tensors after each step they both ran."""

from __future__ import annotations

import collections
import json
import os
import signal

import pytest

from tests.conftest import FIXTURE_ZOO
from tests.integration.helpers import kill_job_tree, live_replicas, read_json, start_cli, wait_for

pytestmark = pytest.mark.integration


def _entries(digest_dir):
    out = []
    for name in sorted(os.listdir(digest_dir)):
        with open(os.path.join(digest_dir, name)) as f:
            for line in f:
                if line.strip():
                    out.append((name, json.loads(line)))
    return out


def _steps_done(digest_dir):
    try:
        return len(_entries(digest_dir))
    except (OSError, ValueError):
        return 0


def test_members_parameters_and_buffers_are_bitwise_identical_after_every_step(
        digits_data, tmp_path):
    job_dir = str(tmp_path / "job")
    digests = tmp_path / "digests"
    digests.mkdir()
    args = ["train", f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.bn_digits.custom_model",
            f"--training_data={digits_data}/train", f"--validation_data={digits_data}/val",
            f"--output={job_dir}", "--job_name=ar-consistency", "--cluster=local",
            "--distribution_strategy=AllreduceStrategy", "--num_workers=3",
            "--minibatch_size=32", "--num_epochs=3", "--collective_timeout_s=10",
            f"--envs=DIGEST_DIR={digests},BN_DIGITS_FULL=3"]
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        wait_for(lambda: _steps_done(str(digests)) >= 3 * 10, 240, "training under way")
        pid = wait_for(lambda: next((r["pid"] for r in live_replicas(job_dir)
                                     if r["replica"] == "worker-1"), None), 30, "worker-1")
        os.kill(pid, signal.SIGKILL)
        code = proc.wait(timeout=400)
        assert code == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    assert [e["records_completed"] for e in report["epochs"]] == [1437] * 3
    assert [r["replica"] for r in report["relaunches"]] == ["worker-1"]

    by_step = collections.defaultdict(dict)  # (plan, version) -> replica -> digests
    for replica, e in _entries(str(digests)):
        by_step[(e["plan"], e["version"])][replica] = e["digests"]
    compared = collections.Counter()
    for (plan, version), members in sorted(by_step.items()):
        first_name, first = next(iter(members.items()))
        for name, digest in members.items():
            diff = [k for k in first if digest.get(k) != first[k]]
            assert not diff, (f"plan {plan} version {version}: {name} and {first_name} "
                              f"differ in {diff}")
        relaunched = any(n.endswith("worker-3.jsonl") for n in members)
        phase = "between" if len(members) == 2 else "after" if relaunched else "before"
        compared[phase] += len(members) > 1
    names = {replica for _, members in by_step.items() for replica in members}
    assert any(n.endswith("worker-3.jsonl") for n in names), names  # the relaunched worker trained
    tensors = next(iter(next(iter(by_step.values())).values()))
    assert any("running_mean" in k for k in tensors) and any("running_var" in k for k in tensors)
    # steps checked across the 3 first members (the kill came after ~10 steps), across
    # the 2 survivors, and across 3 members again once the relaunched worker joined (how
    # many of those is timing: the rejoin can come late in a loaded machine's short job)
    assert compared["before"] >= 8 and compared["between"] >= 1 and \
        compared["after"] >= 1, compared
