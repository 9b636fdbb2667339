import dataclasses
import json
import os
import subprocess
import sys

import pytest

from elasticdl.common.job_spec import JobSpec, JobSpecError, cli_fields, job_spec_from_flags
from elasticdl.common.resources import parse_params, parse_resources, parse_volumes

BASE = {"model_zoo": "model_zoo", "model_def": "digits.digits_cnn.custom_model",
        "training_data": "data/train"}


def spec(**flags):
    return job_spec_from_flags("train", {**BASE, **flags})


def test_defaults_and_derived_values():
    s = spec()
    assert s.minibatch_size == 64 and s.num_minibatches_per_task == 8 and s.num_epochs == 1
    assert s.cluster == "local" and s.distribution_strategy == "Local"
    assert s.job_name.startswith("digits-cnn-") or s.job_name.startswith("digits-")
    assert spec(image_name="reg/img:v1").cluster == "k8s"
    assert s.records_per_task == 512


@pytest.mark.parametrize("flags,flag", [
    ({"num_workers": -1}, "num_workers"),
    ({"distribution_strategy": "Magic"}, "distribution_strategy"),
    ({"worker_resource_request": "cpu=abc"}, "worker_resource_request"),
    ({"worker_resource_request": "gpu=0.5"}, "worker_resource_request"),
    ({"ps_resource_limit": "cpus=1"}, "ps_resource_limit"),
    ({"minibatch_size": "many"}, "minibatch_size"),
    ({"use_async": "maybe"}, "use_async"),
    ({"envs": "1A=b"}, "envs"),
    ({"volume": "mount_path=/x"}, "volume"),
    ({"model_params": "noequals"}, "model_params"),
    ({"data_reader_params": "sep"}, "data_reader_params"),
    ({"job_name": "Bad_Name"}, "job_name"),
    ({"bogus_flag": 1}, "bogus_flag"),
    ({"model_def": ""}, "model_def"),
    ({"device": "tpu"}, "device"),
    ({"num_workers": 2}, "num_workers"),  # Local strategy trains in one process
])
def test_bad_values_name_the_flag(flags, flag):
    with pytest.raises(JobSpecError) as e:
        spec(**flags)
    assert e.value.flag == flag
    assert f"--{flag}" in str(e.value)


def test_fire_value_quirks_are_undone():
    s = spec(worker_resource_request=("cpu=1", "memory=1Gi"), job_name=7, use_async=False)
    assert s.worker_resource_request == "cpu=1,memory=1Gi"
    assert s.job_name == "7"


def test_required_per_job_type():
    with pytest.raises(JobSpecError, match="--checkpoint_dir_for_init"):
        job_spec_from_flags("evaluate", {**BASE, "validation_data": "v"})
    with pytest.raises(JobSpecError, match="--output"):
        job_spec_from_flags("predict", {**BASE, "prediction_data": "p",
                                        "checkpoint_dir_for_init": "c"})


def test_json_round_trip_and_frozen():
    s = spec(num_workers=3, model_params="a=1;b=x",
             distribution_strategy="ParameterServerStrategy")
    assert JobSpec.from_json(s.to_json()) == s
    assert s.model_kwargs == {"a": 1, "b": "x"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_workers = 2  # type: ignore[misc]
    bad = json.loads(s.to_json())
    bad["nope"] = 1
    with pytest.raises(JobSpecError):
        JobSpec.from_json(json.dumps(bad))


def test_parsers():
    assert parse_resources("cpu=500m,memory=4096Mi,gpu=1") == {
        "cpu": "500m", "memory": "4096Mi", "nvidia.com/gpu": "1"}
    assert parse_params("lr=0.1;n=3;on=true;s=abc") == {"lr": 0.1, "n": 3, "on": True,
                                                         "s": "abc"}
    assert parse_volumes("claim_name=c,mount_path=/m") == [{"claim_name": "c",
                                                            "mount_path": "/m"}]
    with pytest.raises(ValueError):
        parse_volumes("host_path=/a,claim_name=c,mount_path=/m")


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "elasticdl_client.main", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PAGER": "cat"})


@pytest.mark.parametrize("flag,value", [
    ("num_workers", "-1"), ("distribution_strategy", "Magic"),
    ("worker_resource_request", "cpu=abc")])
def test_cli_exits_2_naming_the_flag(flag, value):
    r = run_cli("train", "--model_zoo=model_zoo", "--model_def=digits.digits_cnn.custom_model",
                "--training_data=x", f"--{flag}={value}")
    assert r.returncode == 2, r.stderr
    assert f"--{flag}" in r.stderr


def test_cli_missing_model_def():
    r = run_cli("train", "--model_zoo=model_zoo", "--training_data=x")
    assert r.returncode == 2 and "--model_def" in r.stderr


def test_cli_help_documents_every_flag():
    r = run_cli("train", "--help")
    assert r.returncode == 0
    text = r.stdout + r.stderr
    missing = [f.name for f in cli_fields() if f"--{f.name}" not in text]
    assert not missing, missing


def test_cli_reference_is_current():
    from scripts.gen_cli_docs import render

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "cli.md")) as f:
        assert f.read() == render(), "run: python scripts/gen_cli_docs.py > docs/cli.md"


@pytest.mark.parametrize("typo,suggestion", [
    ("--num_worker=3", "--num_workers"), ("--minibatch-sise=32", "--minibatch_size"),
    ("--evaluation_step", "--evaluation_steps")])
def test_typo_flag_names_the_closest_valid_one(typo, suggestion):
    """Issue 11 (the CLI-level test is in tests/integration/test_chaos.py)."""
    from elasticdl_client.main import UsageError, check_job_flags

    with pytest.raises(UsageError, match=f"did you mean {suggestion}\\?"):
        check_job_flags("train", ["--model_def=a.b", typo])


def test_check_job_flags_accepts_fire_forms():
    from elasticdl_client.main import UsageError, check_job_flags

    check_job_flags("train", ["--num_workers", "3", "--shuffle", "--noshuffle", "--use-async",
                              "--minibatch_size=8", "--", "--help"])
    with pytest.raises(UsageError, match="unexpected argument 'junk'"):
        check_job_flags("train", ["--num_workers=3", "junk"])
    with pytest.raises(UsageError, match=r"unknown flag --zzz \(see"):
        check_job_flags("train", ["--zzz=1"])


def test_autoscale_needs_a_range_and_a_fraction():
    ps = {"distribution_strategy": "ParameterServerStrategy"}
    s = spec(**ps, num_workers="2:5", autoscale="0.25")
    assert (s.autoscale, s.workers_min, s.num_workers) == (0.25, 2, 5)
    assert s.initial_workers == 2
    assert spec(**ps, num_workers="2:5").initial_workers == 5
    with pytest.raises(JobSpecError, match="--autoscale.*MIN:MAX with MIN < MAX"):
        spec(**ps, num_workers="3", autoscale="0.2")
    with pytest.raises(JobSpecError, match="--autoscale.*fraction"):
        spec(**ps, num_workers="1:3", autoscale="1.5")


def test_each_replica_runs_as_many_compute_threads_as_it_has_cpus():
    """torch would start a thread per core of the machine in every replica: replicas
    sharing cores (a node, a --cluster=local job) spin against each other."""
    from elasticdl.common.resources import cpu_threads
    from elasticdl.master.replica_launcher import ReplicaLauncher, WorkerLaunch

    assert [cpu_threads(q) for q in ("2", "500m", "1.5", "2500m", "")] == [2, 1, 1, 2, 0]

    def threads(**flags):
        launcher = ReplicaLauncher(spec(**flags), cluster=None, master_addr="m:1")
        return launcher.replica_spec(WorkerLaunch(0)).env.get("OMP_NUM_THREADS")

    assert threads() == "1"                                   # the default request, cpu=1
    assert threads(worker_resource_request="cpu=3,memory=1Gi") == "3"
    assert threads(worker_resource_request="cpu=1", worker_resource_limit="cpu=4") == "4"
    assert threads(envs="OMP_NUM_THREADS=2") == "2"           # the user's word stands
