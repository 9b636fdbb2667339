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
