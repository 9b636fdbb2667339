"""Shared fixtures: the repo root, a prepared digits dataset, a tiny model zoo."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_ZOO = os.path.join(ROOT, "model_zoo")
FIXTURE_ZOO = os.path.join(ROOT, "tests", "fixtures", "zoo")


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory) -> str:
    """The digits dataset in npz and csv, written once per test session."""
    out = tmp_path_factory.mktemp("digits")
    subprocess.run([sys.executable, os.path.join(MODEL_ZOO, "digits", "prepare_data.py"),
                    f"--output={out}", "--format=both"], check=True, capture_output=True,
                   timeout=120)
    return str(out)


ID_RECORDS = 512  # records of the id dataset (tests/fixtures/zoo/toy/count_records.py)


@pytest.fixture(scope="session")
def id_data(tmp_path_factory) -> str:
    """Records that are their own ids (0..ID_RECORDS-1), for the record-counting model."""
    import numpy as np

    out = tmp_path_factory.mktemp("ids")
    np.save(out / "ids.npy", np.arange(ID_RECORDS, dtype=np.int64))
    return str(out)


@pytest.fixture(autouse=True)
def _data_endpoint_restored():
    """A job run in the test process (Local) exports its ``--data_endpoint`` to the
    process (``elasticdl.data.fs.configure_from_spec``): restored after every test, so no
    later test (or job it starts) reads another test's endpoint."""
    name = "ELASTICDL_DATA_ENDPOINT"
    saved = os.environ.get(name)
    yield
    if saved is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = saved
