"""The object-storage tier: a real S3 server (SeaweedFS) for the whole session, and the digits
dataset in a bucket as CSV, Parquet and NumPy.

The server starts once (bounded by :data:`tests.s3.seaweed.START_TIMEOUT_S`), is always
stopped at the end, and every test of this folder is skipped, with the reason, where it
cannot start (no ``weed`` binary, no free port, no answer in time). Its client and the
job's are pyarrow's S3 file system (a dev dependency: missing, the tier fails, not skips).
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from tests.s3.seaweed import SeaweedS3, SeaweedUnavailable

BUCKET = "digits"
PARQUET_ROW_GROUP = 128


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A running SeaweedFS S3 server; the test process gets its endpoint and credentials
    in the environment (as a job would)."""
    try:
        server = SeaweedS3(str(tmp_path_factory.mktemp("seaweed")))
        server.start()
    except SeaweedUnavailable as err:
        pytest.skip(f"SeaweedFS S3 server cannot start here: {err}")
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(autouse=True)
def _fresh_s3_clients():
    """Each test starts with no cached file system or object handle of the fs layer (a
    change of credentials or endpoint gets a new client anyway; this also drops handles of
    objects another test rewrote)."""
    from elasticdl.data import fs

    fs._clear_cache()
    yield
    fs._clear_cache()


def write_parquet(npz_dir: str, out_dir: str, row_group: int = PARQUET_ROW_GROUP) -> int:
    """The digits npz shards of ``npz_dir`` as Parquet (``image``: 784 floats, ``label``),
    small row groups so that a task reads some of a file's groups; returns the records."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out_dir, exist_ok=True)
    total = 0
    for path in sorted(glob.glob(os.path.join(npz_dir, "*.npz"))):
        with np.load(path) as npz:
            images = npz["image"].reshape(len(npz["image"]), -1)
            labels = npz["label"]
        table = pa.table({"image": pa.array(list(images), type=pa.list_(pa.float32())),
                          "label": pa.array(labels, type=pa.int64())})
        name = os.path.basename(path).replace(".npz", ".parquet")
        pq.write_table(table, os.path.join(out_dir, name), row_group_size=row_group)
        total += len(labels)
    return total


@pytest.fixture(scope="session")
def s3_digits(s3_server, digits_data, tmp_path_factory):
    """``{name: (s3 URL, local dir)}`` of digits splits in the bucket: ``train_csv``,
    ``val_csv``, ``train_parquet``, ``val_parquet``, ``train`` and ``val`` (npz)."""
    local = str(tmp_path_factory.mktemp("digits_parquet"))
    out = {}
    for split in ("train", "val"):
        pq_dir = os.path.join(local, f"{split}_parquet")
        write_parquet(os.path.join(digits_data, split), pq_dir)
        for name, src in ((f"{split}_csv", os.path.join(digits_data, f"{split}_csv")),
                          (f"{split}_parquet", pq_dir),
                          (split, os.path.join(digits_data, split))):
            url = f"s3://{BUCKET}/{name}"
            s3_server.upload_dir(src, url)
            out[name] = (url, src)
    return out
