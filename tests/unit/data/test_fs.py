"""Unit tests of the file-system layer (elasticdl.data.fs) without a server: URL handling,
fault classification, the bounded retry loop, local-path operations and missing extras."""

from __future__ import annotations

import errno
import logging
import sys
import time

import numpy as np
import pytest

from elasticdl.data import DataError, MalformedRecordError, create_data_reader, fs
from elasticdl.data.fs_faults import is_not_found

# pyarrow's errors as observed against a SeaweedFS S3 server (tests/s3) and, for the codes
# it does not produce (SlowDown, 5xx, throttling, timeouts), a stub HTTP server answering S3
# error documents; pyarrow raises OSError (FileNotFoundError for a missing object) whose
# message names the AWS SDK's error
REFUSED = ("When getting information for key 'a/x.csv' in bucket 'bkt': AWS Error "
           "NETWORK_CONNECTION during HeadObject operation: curlCode: 7, Could not connect to "
           "server; Details: Failed to connect to 127.0.0.1:49017 after 0 ms: Could not "
           "connect to server")
CUT_SHORT = ("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 18, "
             "Transferred a partial file; Details: end of response with 23416439 bytes missing")
TIMED_OUT = ("When listing objects under key 'p/' in bucket 'b': AWS Error NETWORK_CONNECTION "
             "during ListObjectsV2 operation: curlCode: 28, Timeout was reached; Details: "
             "Operation too slow. Less than 1 bytes/sec transferred the last 2 seconds")
RESTARTING = ("AWS Error INTERNAL_FAILURE during GetObject operation: Failed to flush response "
              "stream (eof: 0, bad: 1)")
SLOW_DOWN = ("When listing objects under key 'p/' in bucket 'b': AWS Error SLOW_DOWN during "
             "ListObjectsV2 operation: Please reduce your request rate. (Request ID: r1)")
HEAD_503 = ("When getting information for key 'k' in bucket 'b': AWS Error UNKNOWN (HTTP status "
            "503) during HeadObject operation: No response body.")
SERVICE_UNAVAILABLE = ("When listing objects under key 'p/' in bucket 'b': AWS Error "
                       "SERVICE_UNAVAILABLE during ListObjectsV2 operation: Service unavailable")
THROTTLING = ("When listing objects under key 'p/' in bucket 'b': AWS Error THROTTLING during "
              "ListObjectsV2 operation: Rate exceeded (Request ID: r1)")
TOO_MANY = ("When listing objects under key 'p/' in bucket 'b': AWS Error UNKNOWN (HTTP status "
            "429) during ListObjectsV2 operation: Unable to parse ExceptionName: "
            "TooManyRequests Message: slow (Request ID: r1)")
ACCESS_DENIED = ("When getting information for key 'a/x.csv' in bucket 'bkt': AWS Error "
                 "ACCESS_DENIED during HeadObject operation: No response body.")
BAD_SIGNATURE = ("When listing objects under key 'a/' in bucket 'bkt': AWS Error "
                 "SIGNATURE_DOES_NOT_MATCH during ListObjectsV2 operation: The request "
                 "signature we calculated does not match the signature you provided. Check "
                 "your key and signing method. (Request ID: 18EC2839C87AFE4B50744E55)")
BAD_KEY_ID = ("When listing objects under key 'p/' in bucket 'b': AWS Error "
              "INVALID_ACCESS_KEY_ID during ListObjectsV2 operation: no such key id")
NO_SUCH_BUCKET = ("When listing objects under key 'train/' in bucket 'no-such-bucket': AWS "
                  "Error NO_SUCH_BUCKET during ListObjectsV2 operation: The specified bucket "
                  "does not exist (Request ID: 18EC2839C80CD76912B27DC4)")
NO_SUCH_KEY = ("When listing objects under key 'k' in bucket 'b': AWS Error NO_SUCH_KEY during "
               "ListObjectsV2 operation: The specified key does not exist. (Request ID: r1)")
MISSING = "[Errno 2] Path does not exist 'bkt/a/none.csv'. Detail: [errno 2] No such file"


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
    OSError(REFUSED), OSError(CUT_SHORT), OSError(TIMED_OUT), OSError(RESTARTING),
    OSError(SLOW_DOWN), OSError(HEAD_503), OSError(SERVICE_UNAVAILABLE), OSError(THROTTLING),
    OSError(TOO_MANY),
    OSError("google::cloud::Status(UNAVAILABLE: connection reset)"),
    ConnectionResetError("reset"), ConnectionRefusedError("refused"), TimeoutError("slow"),
    OSError(errno.ETIMEDOUT, "timed out"),
])
def test_transient_errors(err):
    assert fs.is_transient(err)
    wrapped = DataError("s3://b/k: cannot read as Parquet")
    wrapped.__cause__ = err
    assert fs.is_transient(wrapped)


@pytest.mark.parametrize("err,reason", [
    (OSError(ACCESS_DENIED), "access denied"), (OSError(BAD_SIGNATURE), "access denied"),
    (OSError(BAD_KEY_ID), "access denied"),
    (OSError("AWS Error UNKNOWN (HTTP status 403) during HeadObject operation"),
     "access denied"),
    (PermissionError("google::cloud::Status(PERMISSION_DENIED: no)"), "access denied"),
    (OSError(NO_SUCH_BUCKET), "no such bucket or object"),
    (OSError(NO_SUCH_KEY), "no such bucket or object"),
    (FileNotFoundError(errno.ENOENT, MISSING), "no such bucket or object"),
    (OSError("google::cloud::Status(NOT_FOUND: gone)"), "no such bucket or object"),
    (OSError(errno.EINVAL, "bad range"), "OSError"),
])
def test_permanent_errors(err, reason):
    assert not fs.is_transient(err)
    with pytest.raises(DataError, match=rf"^s3://b/k: cannot read: {reason}") as raised:
        fs.retrying("s3://b/k", "read", lambda: (_ for _ in ()).throw(err), budget_s=30)
    assert raised.value.__cause__ is err


@pytest.mark.parametrize("err", [
    MalformedRecordError("s3://b/k", 3, "expected 3 fields, got 2"), ValueError("bad"),
    IsADirectoryError("s3://b/k is a directory"),
])
def test_other_permanent_errors(err):
    assert not fs.is_transient(err)


def test_not_found():
    assert is_not_found(OSError(NO_SUCH_BUCKET))
    assert is_not_found(FileNotFoundError(MISSING))
    assert not is_not_found(OSError(ACCESS_DENIED))
    assert not is_not_found(OSError(REFUSED))


def test_not_found_wins_over_a_transient_cause():
    err = FileNotFoundError("no such key")
    err.__context__ = OSError(REFUSED)
    assert not fs.is_transient(err)
    denied = OSError(ACCESS_DENIED)
    denied.__context__ = OSError(SLOW_DOWN)
    assert not fs.is_transient(denied)


def test_retrying_recovers_from_transient_errors(caplog):
    calls = []

    def op():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise OSError(REFUSED)
        return "data"

    with caplog.at_level(logging.WARNING, logger="elasticdl.data.fs"):
        assert fs.retrying("s3://b/k.csv", "read", op, budget_s=10) == "data"
    assert len(calls) == 3
    assert "s3://b/k.csv" in caplog.text and "retry 2" in caplog.text


def test_retrying_fails_fast_on_permanent_errors():
    calls = []

    def op():
        calls.append(1)
        raise OSError(BAD_SIGNATURE)

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
    monkeypatch.setitem(sys.modules, "pyarrow.fs", None)     # as if pyarrow were missing
    with pytest.raises(DataError, match=r"s3://bucket/train: reading s3:// URLs requires "
                       r"pyarrow and fsspec.*pip install 'elasticdl-pytorch\[s3\]'"):
        create_data_reader("s3://bucket/train")
    with pytest.raises(DataError, match=r"pip install 'elasticdl-pytorch\[gcs\]'"):
        fs.filesystem("gs://bucket/train")


def test_s3_options_from_spec_and_environment(monkeypatch):
    pytest.importorskip("pyarrow.fs")
    for name in (fs.ENDPOINT_ENV, "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://env:9000")
    options = fs._s3_options()
    assert (options["endpoint_override"], options["scheme"], options["region"]) == \
        ("env:9000", "http", fs.DEFAULT_REGION)
    assert (options["connect_timeout"], options["request_timeout"]) == \
        (fs.CONNECT_TIMEOUT_S, fs.REQUEST_TIMEOUT_S)

    class Spec:
        data_endpoint = "https://flag.example:9443"

    # recorded as unset first, so the test leaves it unset whatever configure_from_spec
    # writes (a leaked endpoint sent every later s3 test of this process to flag.example)
    monkeypatch.setenv(fs.ENDPOINT_ENV, "")
    fs.configure_from_spec(Spec())
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    options = fs._s3_options()
    assert (options["endpoint_override"], options["scheme"], options["region"]) == \
        ("flag.example:9443", "https", "eu-west-3")
    assert not {"access_key", "secret_key", "session_token"} & set(options)   # SDK chain only
    monkeypatch.delenv(fs.ENDPOINT_ENV)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_REGION")
    assert not {"endpoint_override", "region"} & set(fs._s3_options())    # AWS itself


def test_s3_file_systems_cached_per_environment(monkeypatch):
    pytest.importorskip("pyarrow.fs")
    fs._clear_cache()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id-1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-1")
    first, path = fs.filesystem("s3://bucket/prefix/a.csv")
    assert path == "bucket/prefix/a.csv" and fs.filesystem("s3://bucket/b")[0] is first
    assert type(first.fs).__name__ == "S3FileSystem" and first.protocol == "s3"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-2")
    second = fs.filesystem("s3://bucket/b")[0]
    assert second is not first
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:10")
    assert fs.filesystem("s3://bucket/b")[0] not in (first, second)
    assert not any("secret" in repr(key) for key in fs._instances)
    fs._clear_cache()


def test_dead_endpoint_is_retried_then_named(monkeypatch, caplog):
    """A real pyarrow client against a port nobody listens on: connection refused is
    transient (retried, logged with the URL), then a DataError past the budget."""
    pytest.importorskip("pyarrow.fs")
    fs._clear_cache()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "unit-test-secret")
    monkeypatch.setenv(fs.RETRY_BUDGET_ENV, "1")
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="elasticdl.data.fs"):
        with pytest.raises(DataError, match=r"s3://bucket/k\.csv: cannot read bytes 0-4 after "
                           r"\d+ attempts.*NETWORK_CONNECTION") as err:
            fs.read_range("s3://bucket/k.csv", 0, 4)
    assert time.monotonic() - began < 15
    assert "s3://bucket/k.csv: read bytes 0-4 failed (OSError), retry 1" in caplog.text
    assert "unit-test-secret" not in str(err.value) + caplog.text
    fs._clear_cache()


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
