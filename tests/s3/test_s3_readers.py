"""The built-in readers on s3:// data served by a real S3 server (SeaweedFS): the same records
as from local files, ranged reads only, the CSV index cached by URL+ETag, and faults."""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import pytest

from elasticdl.data import DataError, create_data_reader, fs
from elasticdl.data.csv_reader import INDEX_CACHE_ENV
from tests.s3.conftest import BUCKET


def _same_records(remote, local):
    """Shards and records of two readers of the same data agree (in task-sized ranges)."""
    rs, ls = remote.create_shards(), local.create_shards()
    assert [(s.start, s.count) for s in rs] == [(s.start, s.count) for s in ls]
    assert [os.path.basename(s.name) for s in rs] == [os.path.basename(s.name) for s in ls]
    for r, loc in zip(rs, ls):
        for start in range(0, r.count, 100):
            end = min(r.count, start + 100)
            a, b = remote.read(r.name, start, end), local.read(loc.name, start, end)
            assert len(a) == len(b) == end - start
            for x, y in zip(a, b):
                if isinstance(x, dict):
                    assert x.keys() == y.keys()
                    for k in x:
                        np.testing.assert_array_equal(np.asarray(x[k]), np.asarray(y[k]))
                else:
                    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", ["train_csv", "train_parquet", "val"])
def test_reader_on_s3_matches_local(s3_digits, name, tmp_path, monkeypatch):
    monkeypatch.setenv(INDEX_CACHE_ENV, str(tmp_path / "index"))
    url, local = s3_digits[name]
    remote_reader = create_data_reader(url)
    _same_records(remote_reader, create_data_reader(local))
    assert remote_reader.create_shards()[0].name.startswith(f"s3://{BUCKET}/")


class _Counting:
    """A pyarrow file of the fs layer whose reads are counted (bytes fetched per read)."""

    def __init__(self, file, fetched: list[int]) -> None:
        self._file, self._fetched = file, fetched

    def read_at(self, nbytes, offset):
        data = self._file.read_at(nbytes, offset)
        self._fetched.append(len(data))
        return data

    def read(self, nbytes=None):
        data = self._file.read(nbytes)
        self._fetched.append(len(data))
        return data

    def read_buffer(self, nbytes=None):    # what pyarrow calls on a Python file that has it
        data = self._file.read_buffer(nbytes)
        self._fetched.append(len(data))
        return data

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


def test_reads_are_ranged_never_whole_objects(s3_digits, tmp_path, monkeypatch):
    """A worker's read of a task: CSV one ranged GET of the task's bytes; Parquet the
    footer and the row groups of the task; never the whole object."""
    monkeypatch.setenv(INDEX_CACHE_ENV, str(tmp_path / "index"))
    url, _ = s3_digits["train_csv"]
    master = create_data_reader(url)
    shard = master.create_shards()[0]
    size = fs.info(shard.name).size
    # a worker: a fresh reader, the index from the master's cache
    worker = create_data_reader(url)
    fetched: list[int] = []
    real_handle = fs._handle
    monkeypatch.setattr(fs, "_handle", lambda *a, **kw: _Counting(real_handle(*a, **kw),
                                                                    fetched))
    monkeypatch.setattr(fs, "open_input", _forbid_open)
    monkeypatch.setattr(fs, "read_bytes", _forbid_open)
    rows = worker.read(shard.name, 64, 128)
    assert len(rows) == 64
    # the task's bytes (64 of ~720 records), and once per file the first record (its width)
    assert len(fetched) <= 2 and sum(fetched) < size / 5, (fetched, size)
    fetched.clear()
    assert len(worker.read(shard.name, 128, 192)) == 64
    assert len(fetched) == 1 and fetched[0] < size / 8, (fetched, size)


def _forbid_open(*args, **kwargs):
    raise AssertionError("a CSV read streamed the object: the index was rebuilt")


def test_parquet_reads_only_its_row_groups(s3_digits, monkeypatch):
    """A task's read of a Parquet object fetches its footer and row groups, not the file."""
    fetched: list[int] = []
    real_open = fs.open_input
    monkeypatch.setattr(fs, "open_input", lambda *a, **kw: _Counting(real_open(*a, **kw),
                                                                        fetched))
    url, _ = s3_digits["train_parquet"]
    reader = create_data_reader(url)
    shard = reader.create_shards()[0]
    size = fs.info(shard.name).size
    fetched.clear()
    assert len(reader.read(shard.name, 130, 250)) == 120    # row groups 1 and 2 of 6
    assert 0 < sum(fetched) < size / 2, (fetched, size)


def test_csv_index_cache_keyed_by_etag(s3_server, s3_digits, tmp_path, monkeypatch):
    cache = tmp_path / "index"
    monkeypatch.setenv(INDEX_CACHE_ENV, str(cache))
    fsys = s3_server.filesystem()
    fsys.pipe(f"{BUCKET}/etag/a.csv", b"1,2\n3,4\n")
    assert create_data_reader(f"s3://{BUCKET}/etag").num_records() == 2
    assert len(os.listdir(cache)) == 1
    assert create_data_reader(f"s3://{BUCKET}/etag").num_records() == 2
    assert len(os.listdir(cache)) == 1          # reused
    fsys.pipe(f"{BUCKET}/etag/a.csv", b"1,2\n3,4\n5,6\n")
    assert create_data_reader(f"s3://{BUCKET}/etag").num_records() == 3   # re-indexed
    assert len(os.listdir(cache)) == 2


def test_csv_index_cache_in_the_bucket(s3_server, s3_digits, monkeypatch):
    """Pods that share no disk share the index through object storage."""
    monkeypatch.setenv(INDEX_CACHE_ENV, f"s3://{BUCKET}/_index_cache")
    url, _ = s3_digits["val_csv"]
    n = create_data_reader(url).num_records()
    assert s3_server.filesystem().ls(f"{BUCKET}/_index_cache")
    reader = create_data_reader(url)
    monkeypatch.setattr(fs, "open_input", _forbid_open)
    assert reader.num_records() == n


def test_hf_arrow_directory_on_s3(s3_server, tmp_path):
    datasets = pytest.importorskip("datasets")
    local = str(tmp_path / "hf")
    datasets.Dataset.from_dict({"x": list(range(50)), "y": [str(i) for i in range(50)]}
                               ).save_to_disk(local)
    s3_server.upload_dir(local, f"s3://{BUCKET}/hf")
    reader = create_data_reader(f"s3://{BUCKET}/hf")
    _same_records(reader, create_data_reader(local))


def test_npy_rows_by_range(s3_server, tmp_path):
    local = tmp_path / "npy"
    local.mkdir()
    np.save(local / "a.npy", np.arange(600, dtype=np.float32).reshape(200, 3))
    s3_server.upload_dir(str(local), f"s3://{BUCKET}/npy")
    _same_records(create_data_reader(f"s3://{BUCKET}/npy"), create_data_reader(str(local)))


def test_missing_bucket_and_key_fail_at_once(s3_server):
    began = time.monotonic()
    with pytest.raises(DataError, match=r"s3://no-such-bucket/train.*no such bucket"):
        create_data_reader("s3://no-such-bucket/train")
    with pytest.raises(DataError, match=rf"s3://{BUCKET}/no/such/prefix"):
        create_data_reader(f"s3://{BUCKET}/no/such/prefix")
    assert time.monotonic() - began < 5


def test_wrong_credentials_fail_at_once(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    began = time.monotonic()
    with pytest.raises(DataError, match=rf"s3://{BUCKET}/train_csv: cannot list: access "
                       r"denied") as err:
        create_data_reader(f"s3://{BUCKET}/train_csv")
    assert time.monotonic() - began < 5
    assert "wrong-secret-value" not in str(err.value)


def test_malformed_parquet_object_is_a_data_error(s3_server):
    s3_server.filesystem().pipe(f"{BUCKET}/bad/x.parquet", b"not parquet at all" * 10)
    with pytest.raises(DataError, match=rf"s3://{BUCKET}/bad/x.parquet: cannot read as "
                       "Parquet"):
        create_data_reader(f"s3://{BUCKET}/bad").create_shards()


def test_a_read_survives_a_server_restart(s3_server, s3_digits, tmp_path, monkeypatch,
                                          caplog):
    """The server killed, restarted 3 s later: the read in flight is retried (logged with
    the URL) and returns the right records."""
    monkeypatch.setenv(INDEX_CACHE_ENV, str(tmp_path / "index"))
    url, local = s3_digits["val_csv"]
    reader = create_data_reader(url)
    shard = reader.create_shards()[0]
    expected = create_data_reader(local).read(os.path.join(local, "part-0000.csv"), 0, 50)
    s3_server.stop()
    restart = threading.Timer(3.0, s3_server.start)
    restart.start()
    try:
        with caplog.at_level(logging.WARNING, logger="elasticdl.data.fs"):
            assert reader.read(shard.name, 0, 50) == expected
    finally:
        restart.join()
        if s3_server.proc is None:
            s3_server.start()
    assert f"{shard.name}: read bytes 0-" in caplog.text and "retry 1 in" in caplog.text
