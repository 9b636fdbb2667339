"""Unit tests of the file-system layer (elasticdl.data.fs) without a server: URL handling,
fault classification, the bounded retry loop, local-path operations and missing extras."""

from __future__ import annotations

import errno
import logging
import time

import numpy as np
import pytest

from elasticdl.data import DataError, MalformedRecordError, create_data_reader, fs


class ClientError(Exception):
    """Shaped like botocore's ClientError (a ``response`` dict)."""

    def __init__(self, code: str, status: int) -> None:
        super().__init__(f"An error occurred ({code})")
        self.response = {"Error": {"Code": code},
                         "ResponseMetadata": {"HTTPStatusCode": status}}


class EndpointConnectionError(Exception):
    """Named like botocore's (classified by name: botocore need not be importable)."""


def test_urls_and_paths(tmp_path):
    assert fs.is_url("s3://b/k") and fs.is_url("gs://b/k") and fs.is_url("hdfs://nn/p")
    assert not fs.is_url("/data/x.csv") and not fs.is_url("file:///data/x.csv")
    assert not fs.is_url("data/x.csv")
    assert fs.normalize("S3://b/prefix/") == "s3://b/prefix"
    assert fs.normalize("file:///tmp/x.csv") == "/tmp/x.csv"
    assert fs.normalize("x.csv").startswith("/")
    assert fs.join("s3://b/p/", "f.csv") == "s3://b/p/f.csv"
    assert fs.join(str(tmp_path), "f.csv") == str(tmp_path / "f.csv")
    assert fs.redact("s3://AKIA:secret@b/k") == "s3://***@b/k"
    assert fs.redact("s3://b/k@v") == "s3://b/k@v"


@pytest.mark.parametrize("err", [
    ConnectionResetError("reset"), ConnectionRefusedError("refused"), TimeoutError("slow"),
    OSError(121, "We encountered an internal error"),         # s3fs: 500 InternalError
    OSError(errno.EBUSY, "SlowDown"),                          # s3fs: 503
    EndpointConnectionError("Could not connect"),
    ClientError("ServiceUnavailable", 503), ClientError("Whatever", 502),
])
def test_transient_errors(err):
    assert fs.is_transient(err)
    wrapped = DataError("s3://b/k: cannot read")
    wrapped.__cause__ = err
    assert fs.is_transient(wrapped)


@pytest.mark.parametrize("err", [
    FileNotFoundError("The specified bucket does not exist"),
    PermissionError("The request signature we calculated does not match"),
    MalformedRecordError("s3://b/k", 3, "expected 3 fields, got 2"),
    ClientError("AccessDenied", 403), ValueError("bad"), OSError(errno.EINVAL, "bad range"),
])
def test_permanent_errors(err):
    assert not fs.is_transient(err)


def test_not_found_wins_over_a_transient_cause():
    err = FileNotFoundError("no such key")
    err.__context__ = ConnectionResetError("earlier")
    assert not fs.is_transient(err)


def test_retrying_recovers_from_transient_errors(caplog):
    calls = []

    def op():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise EndpointConnectionError("Could not connect to the endpoint URL")
        return "data"

    with caplog.at_level(logging.WARNING, logger="elasticdl.data.fs"):
        assert fs.retrying("s3://b/k.csv", "read", op, budget_s=10) == "data"
    assert len(calls) == 3
    assert "s3://b/k.csv" in caplog.text and "retry 2" in caplog.text


def test_retrying_fails_fast_on_permanent_errors():
    calls = []

    def op():
        calls.append(1)
        raise PermissionError("The request signature we calculated does not match")

    began = time.monotonic()
    with pytest.raises(DataError, match=r"s3://b/k.csv: cannot read: access denied"):
        fs.retrying("s3://b/k.csv", "read", op, budget_s=30)
    assert calls == [1] and time.monotonic() - began < 1


def test_retrying_is_bounded():
    began = time.monotonic()
    with pytest.raises(DataError, match=r"s3://b/k: cannot list after \d+ attempts over"):
        fs.retrying("s3://b/k", "list", lambda: (_ for _ in ()).throw(
            ConnectionResetError("reset")), budget_s=1.0)
    assert time.monotonic() - began < 3


def test_retrying_passes_other_errors_through():
    with pytest.raises(ValueError, match="not an I/O error"):
        fs.retrying("s3://b/k", "read", lambda: (_ for _ in ()).throw(
            ValueError("not an I/O error")), budget_s=5)
    err = MalformedRecordError("s3://b/k", 1, "bad")
    with pytest.raises(MalformedRecordError):
        fs.retrying("s3://b/k", "read", lambda: (_ for _ in ()).throw(err), budget_s=5)


def test_retry_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv(fs.RETRY_BUDGET_ENV, "7.5")
    assert fs.retry_budget_s() == 7.5
    monkeypatch.setenv(fs.RETRY_BUDGET_ENV, "junk")
    assert fs.retry_budget_s() == fs.DEFAULT_RETRY_BUDGET_S


def test_local_operations(tmp_path):
    path = str(tmp_path / "a.bin")
    fs.write_bytes(path, b"0123456789")
    assert fs.read_bytes(path) == b"0123456789"
    assert fs.read_range(path, 2, 5) == b"234"
    assert fs.info(path).size == 10
    assert fs.isfile(path) and fs.exists(path) and fs.isdir(str(tmp_path))
    with pytest.raises(DataError, match="fewer bytes"):
        fs.read_range(path, 8, 20)
    with fs.open_input(path) as f:
        f.seek(4)
        assert f.read(2) == b"45"


def test_file_urls_read_as_local_paths(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.csv").write_text("1,2\n3,4\n")
    reader = create_data_reader(f"file://{tmp_path}/d")
    assert reader.create_shards()[0].name == str(tmp_path / "d" / "x.csv")
    assert reader.read(str(tmp_path / "d" / "x.csv"), 0, 2) == [["1", "2"], ["3", "4"]]


def test_unknown_scheme_and_missing_library(monkeypatch):
    with pytest.raises(DataError, match=r"ftp://h/x: unsupported URL scheme 'ftp'"):
        fs.filesystem("ftp://h/x")
    monkeypatch.setitem(fs._PROTOCOLS, "s3", ("s3", "no_such_s3_module_xyz", fs._EXTRA))
    with pytest.raises(DataError, match=r"requires no_such_s3_module_xyz.*"
                       r"pip install 'elasticdl-pytorch\[s3\]'"):
        create_data_reader("s3://bucket/train")


def test_endpoint_from_spec_and_environment(monkeypatch):
    monkeypatch.delenv(fs.ENDPOINT_ENV, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://env:9000")
    assert fs._storage_options("s3")["client_kwargs"] == {"endpoint_url": "http://env:9000"}

    class Spec:
        data_endpoint = "http://flag:9000"

    fs.configure_from_spec(Spec())
    assert fs._storage_options("s3")["client_kwargs"] == {"endpoint_url": "http://flag:9000"}
    assert "key" not in fs._storage_options("s3")   # credentials: botocore's chain only
    monkeypatch.delenv(fs.ENDPOINT_ENV)


def test_job_spec_data_endpoint_is_validated():
    from elasticdl.common.job_spec import JobSpec, JobSpecError

    spec = JobSpec(model_zoo="z", model_def="m.f", training_data="s3://b/t",
                   data_endpoint="http://127.0.0.1:9000")
    assert spec.data_endpoint == "http://127.0.0.1:9000"
    for bad in ("127.0.0.1:9000", "http://key:secret@host:9000"):
        with pytest.raises(JobSpecError, match="--data_endpoint"):
            JobSpec(model_zoo="z", model_def="m.f", training_data="x", data_endpoint=bad)


def test_local_readers_unchanged(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(10))
    reader = create_data_reader(str(tmp_path))
    assert [int(x) for x in reader.read(str(tmp_path / "a.npy"), 3, 6)] == [3, 4, 5]


def test_parquet_tasks_in_one_row_group_decode_it_once(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from elasticdl.data import parquet_reader

    pq.write_table(pa.table({"x": list(range(1000))}), tmp_path / "a.parquet",
                   row_group_size=400)
    reader = create_data_reader(str(tmp_path))
    path = str(tmp_path / "a.parquet")
    decoded: list[int] = []
    real = pq.ParquetFile.read_row_group

    def counting(self, i, *args, **kwargs):
        decoded.append(i)
        return real(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    rows = [r["x"] for start in range(0, 1000, 100) for r in reader.read(path, start,
                                                                         start + 100)]
    assert rows == list(range(1000)) and decoded == [0, 1, 2]
    assert [r["x"] for r in reader.read(path, 350, 450)] == list(range(350, 450))
    assert decoded == [0, 1, 2]                      # from the kept groups
    monkeypatch.setattr(parquet_reader, "ROW_GROUP_CACHE_BYTES", 0)   # nothing kept
    fresh = create_data_reader(str(tmp_path))
    fresh.read(path, 0, 10)
    fresh.read(path, 10, 20)
    assert decoded[3:] == [0, 0]


def test_checkpoint_urls_accepted_output_urls_refused():
    from elasticdl.common.job_spec import JobSpec, JobSpecError

    def spec(**kw):
        return JobSpec(model_zoo="z", model_def="m.f", training_data="s3://b/t", **kw)

    assert spec(checkpoint_dir="s3://b/ckpt").checkpoint_dir == "s3://b/ckpt"
    assert spec(checkpoint_dir_for_init="s3://b/ckpt/version-7").checkpoint_dir_for_init
    for flag, value in (("output", "s3://b/out"), ("checkpoint_dir", "ftp://h/ckpt"),
                        ("checkpoint_dir", "s3://key:secret@b/ckpt")):
        with pytest.raises(JobSpecError, match=rf"--{flag}: URLs are supported for data and"):
            spec(**{flag: value})
