"""``--data_secret``: object-storage credentials reach every pod of a Kubernetes job as a
reference to a Secret (``envFrom``); no value is in any manifest or the job spec."""

from __future__ import annotations

import json

import pytest

from elasticdl.cluster import k8s_master as km
from elasticdl.cluster import manifests as mf
from elasticdl.cluster.api import ReplicaSpec, ReplicaType
from elasticdl.common.job_spec import JobSpecError
from tests.k8s.test_manifests import all_manifests, spec, validate

pytestmark = pytest.mark.k8s


def test_every_pod_reads_the_data_secret_by_reference():
    job = spec(training_data="s3://digits/train", data_endpoint="http://minio.storage:9000",
               data_secret="s3-credentials")
    pods = [obj for obj in all_manifests(job) if obj["kind"] in ("Pod", "Job")]
    assert len(pods) >= 4
    for obj in all_manifests(job):
        validate(obj)
    for obj in pods:
        template = obj["spec"]["template"] if obj["kind"] == "Job" else obj
        container = template["spec"]["containers"][0]
        assert container["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}], obj
    assert "http://minio.storage:9000" in json.dumps(km.master_pod(job, base=42000))
    worker = mf.replica_pod(job, ReplicaSpec(job.job_name, ReplicaType.WORKER, 0,
                                             ("python", "-m", "x")))
    assert not any(e["name"].startswith("AWS_") for e in worker["spec"]["containers"][0]["env"])


def test_no_secret_no_env_from():
    for obj in all_manifests(spec()):
        pod = obj["spec"].get("template", obj)
        if "containers" in pod.get("spec", {}):
            assert "envFrom" not in pod["spec"]["containers"][0]


def test_data_secret_must_be_a_secret_name():
    with pytest.raises(JobSpecError, match="--data_secret"):
        spec(data_secret="Not A Name")
