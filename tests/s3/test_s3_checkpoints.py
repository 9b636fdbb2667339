"""Checkpoints in object storage (``--checkpoint_dir=s3://...``) on a real S3 server: the
mirror uploads each complete version with its ``DONE`` marker last and applies retention;
a Local job killed mid-way resumes from the bucket and trains every record once per epoch
(the counting model: its parameters show it);
a PS job (``--cluster=local``) writes its shards there."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from elasticdl.checkpoint import remote
from elasticdl.checkpoint.mirror import CheckpointMirror
from elasticdl.checkpoint.paths import DONE, CheckpointError, complete_versions
from elasticdl.data import fs
from tests.conftest import FIXTURE_ZOO, ID_RECORDS, MODEL_ZOO
from tests.integration.helpers import kill_job_tree, read_json, start_cli, wait_for

BUCKET = "checkpoints"


@pytest.fixture(scope="module")
def bucket(s3_server):
    fsys = s3_server.filesystem()
    if not fsys.exists(BUCKET):
        fsys.mkdir(BUCKET)
    return f"s3://{BUCKET}"


def _version(local: str, v: int, done: bool = True) -> None:
    vdir = os.path.join(local, f"version-{v}")
    os.makedirs(os.path.join(vdir, "sub"), exist_ok=True)
    for name, data in (("model.pt", b"weights-%d" % v), ("sub/trained-group.json", b"{}")):
        with open(os.path.join(vdir, name), "wb") as f:
            f.write(data)
    if done:
        with open(os.path.join(vdir, DONE), "w") as f:
            f.write(str(v))


def test_mirror_uploads_done_last_and_applies_retention(bucket, tmp_path, monkeypatch):
    local, url = str(tmp_path / "stage"), f"{bucket}/mirror"
    os.makedirs(local)
    with open(os.path.join(local, "tasks.jsonl"), "w") as f:
        f.write('{"pieces": {}}\n')
    _version(local, 3)
    _version(local, 5, done=False)
    order: list[str] = []
    real_upload = fs.upload
    monkeypatch.setattr(fs, "upload", lambda p, u: (order.append(u), real_upload(p, u)))
    mirror = CheckpointMirror(local, url, keep_max=1)
    assert mirror.sync() == [3]
    done3 = order.index(f"{url}/version-3/{DONE}")   # after every file of version 3
    assert {f"{url}/tasks.jsonl", f"{url}/version-3/sub/trained-group.json",
            f"{url}/version-3/model.pt"} <= set(order[:done3])
    assert f"{url}/version-5/{DONE}" not in order
    assert remote.remote_versions(url) == [3]   # 5's files up, no DONE: not complete
    _version(local, 5)
    import shutil

    shutil.rmtree(os.path.join(local, "version-3"))   # what --keep_checkpoint_max=1 does
    assert mirror.sync() == [5]
    assert remote.remote_versions(url) == [5]
    # every object of version 3 deleted (SeaweedFS may keep empty folder entries)
    import pyarrow.fs as pafs

    left = fs.filesystem(url)[0].fs.get_file_info(pafs.FileSelector(
        f"{BUCKET}/mirror/version-3", recursive=True, allow_not_found=True))
    assert not [d.path for d in left if d.type.name == "File"], left
    got = remote.download_checkpoint(url, str(tmp_path / "back"))
    assert complete_versions(got) == [5]
    with open(os.path.join(got, "version-5", "model.pt"), "rb") as f:
        assert f.read() == b"weights-5"
    assert os.path.exists(os.path.join(got, "tasks.jsonl"))
    one = remote.download_checkpoint(f"{url}/version-5", str(tmp_path / "one"))
    assert one.endswith("version-5") and os.path.exists(os.path.join(one, DONE))
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        remote.download_checkpoint(f"{bucket}/nothing-here", str(tmp_path / "none"))


@pytest.fixture(scope="module")
def small_digits(digits_data, tmp_path_factory) -> str:
    """192 training records, 64 validation records."""
    out = tmp_path_factory.mktemp("s3_ckpt_digits")
    for split, n in (("train", 192), ("val", 64)):
        os.makedirs(out / split)
        with np.load(os.path.join(digits_data, split, "part-0000.npz")) as z:
            np.savez(out / split / "part-0000.npz", image=z["image"][:n], label=z["label"][:n])
    return str(out)


def _args(data: str, out: str, job: str, ckpt: str, *extra: str) -> list[str]:
    return ["train", f"--model_zoo={MODEL_ZOO}", "--model_def=digits.digits_cnn.custom_model",
            f"--training_data={data}/train", f"--validation_data={data}/val",
            f"--output={out}", f"--job_name={job}", "--cluster=local",
            f"--checkpoint_dir={ckpt}", *extra]


def _run(args: list[str], tmp_path, name: str, timeout: int = 500) -> dict:
    out = next(a.split("=", 1)[1] for a in args if a.startswith("--output="))
    proc = start_cli(args, str(tmp_path / "home"), str(tmp_path / f"{name}.log"))
    try:
        assert proc.wait(timeout=timeout) == 0, (tmp_path / f"{name}.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, out)
    return read_json(os.path.join(out, "job_report.json"))


KILLED_EPOCHS = 2
KILLED_VERSIONS = KILLED_EPOCHS * ID_RECORDS // 32   # one minibatch of 32 a version


def _count_args(data: str, out: str, job: str, ckpt: str, *extra: str) -> list[str]:
    return ["train", f"--model_zoo={FIXTURE_ZOO}", "--model_def=toy.count_records.custom_model",
            f"--training_data={data}", f"--output={out}", f"--job_name={job}",
            "--cluster=local", f"--checkpoint_dir={ckpt}", f"--num_epochs={KILLED_EPOCHS}",
            "--minibatch_size=32", "--num_minibatches_per_task=1", "--checkpoint_steps=4",
            "--keep_checkpoint_max=2", *extra]


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_local_job_killed_resumes_from_the_bucket(bucket, id_data, tmp_path):
    """The counting model, paced (0.15 s a minibatch: unpaced, the job ended before the
    bucket showed a version past epoch 0), killed once the bucket holds one; the resumed
    job trains every record exactly once per epoch in all."""
    ckpt = f"{bucket}/local-killed"
    env = {"COUNT_RECORDS": str(ID_RECORDS), "COUNT_RECORDS_DELAY_S": "0.15"}
    epoch_versions = ID_RECORDS // 32
    out_a = str(tmp_path / "a")
    proc = start_cli(_count_args(id_data, out_a, "s3-killed-a", ckpt),
                     str(tmp_path / "home"), str(tmp_path / "a.log"), **env)
    try:
        wait_for(lambda: any(v > epoch_versions for v in remote.remote_versions(ckpt)), 250,
                 "a checkpoint past epoch 0 in the bucket", interval_s=0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        kill_job_tree(proc, out_a)
    uploaded = remote.remote_versions(ckpt)
    resumed_from = max(uploaded)
    assert resumed_from < KILLED_VERSIONS, "the job finished before it was killed"
    # retention applied in the bucket too: the 2 kept, and at most 2 more uploaded in
    # the mirror's last pass before it pruned (the kill can fall between the two)
    assert len(uploaded) <= 4, uploaded
    # the same prefix again without resuming from it: refused, naming both flags
    rc_log = tmp_path / "refused.log"
    proc = start_cli(_count_args(id_data, str(tmp_path / "r"), "s3-refused", ckpt),
                     str(tmp_path / "home"), str(rc_log), **env)
    assert proc.wait(timeout=120) == 2
    assert "already holds complete checkpoints" in rc_log.read_text()
    out_b = str(tmp_path / "b")
    proc = start_cli(_count_args(id_data, out_b, "s3-killed-b", ckpt,
                                 f"--checkpoint_dir_for_init={ckpt}"),
                     str(tmp_path / "home"), str(tmp_path / "b.log"), COUNT_RECORDS=str(ID_RECORDS))
    try:
        assert proc.wait(timeout=500) == 0, (tmp_path / "b.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, out_b)
    report = read_json(os.path.join(out_b, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    assert report["resumed_from_version"] == resumed_from
    assert [e["records_completed"] for e in report["epochs"]] == [ID_RECORDS] * KILLED_EPOCHS
    assert report["timings"]["training_records_resumed"] == 32 * resumed_from
    assert report["timings"]["training_records_this_run"] == \
        KILLED_EPOCHS * ID_RECORDS - 32 * resumed_from
    state = torch.load(os.path.join(out_b, "model.pt"), weights_only=True)
    for name in ("even", "odd"):   # every record trained once per epoch, over both runs
        assert state[name].tolist() == [KILLED_EPOCHS] * ID_RECORDS, name
    assert max(remote.remote_versions(ckpt)) == KILLED_VERSIONS   # the final model
    assert len(remote.remote_versions(ckpt)) == 2     # retention over the whole prefix


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_ps_job_checkpoints_to_the_bucket(bucket, small_digits, tmp_path):
    ckpt = f"{bucket}/ps"
    flags = ["--num_epochs=2", "--minibatch_size=32", "--num_minibatches_per_task=1",
             "--checkpoint_steps=4", "--distribution_strategy=ParameterServerStrategy",
             "--num_ps_pods=2", "--num_workers=2"]
    report = _run(_args(small_digits, str(tmp_path / "ps"), "s3-ps-ckpt", ckpt, *flags),
                  tmp_path, "ps")
    assert report["status"] == "succeeded", report.get("failure")
    versions = remote.remote_versions(ckpt)
    assert versions and versions[-1] == report["model_version"], (versions, report)
    names = {n for n, _ in fs.list_entries(f"{ckpt}/version-{versions[-1]}")}
    assert {"ps-0-of-2.pt", "ps-1-of-2.pt", DONE} <= names, names
    # resumable from the bucket: a finished job resumed trains nothing more
    again = _run(_args(small_digits, str(tmp_path / "ps2"), "s3-ps-ckpt2", ckpt, *flags,
                       f"--checkpoint_dir_for_init={ckpt}"), tmp_path, "ps2")
    assert again["status"] == "succeeded", again.get("failure")
    assert again["model_version"] == report["model_version"]
    assert [e["records_completed"] for e in again["epochs"]] == [192] * 2
