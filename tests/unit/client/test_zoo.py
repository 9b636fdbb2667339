"""`elasticdl zoo init|build|push` without a Docker engine (fake docker CLIs)."""

from __future__ import annotations

import os
import stat

import pytest

from elasticdl_client import zoo


def fake_docker(tmp_path, body: str) -> str:
    """A `docker` executable on a fresh PATH dir; it logs its argv to calls.txt."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    path = bindir / "docker"
    path.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/calls.txt\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(bindir)


@pytest.fixture
def model_zoo(tmp_path):
    d = tmp_path / "my_zoo"
    (d / "digits").mkdir(parents=True)
    (d / "digits" / "digits_cnn.py").write_text("def custom_model(): ...\n")
    return d


def test_init_writes_a_dockerfile(model_zoo, capsys):
    assert zoo.init(str(model_zoo), base_image="python:3.11-slim") == 0
    text = (model_zoo / "Dockerfile").read_text()
    assert text.splitlines()[1] == "FROM python:3.11-slim"
    assert 'pip install "elasticdl-pytorch"' in text
    assert "COPY . /workspace/my_zoo" in text and "WORKDIR /workspace" in text
    assert "requirements.txt" not in text
    assert (model_zoo / ".dockerignore").exists()
    assert "--model_zoo=my_zoo" in capsys.readouterr().out
    # a second init refuses to clobber; --force rewrites, now with requirements
    assert zoo.init(str(model_zoo)) == 2
    (model_zoo / "requirements.txt").write_text("scikit-learn\n")
    assert zoo.init(str(model_zoo), force=True) == 0
    text = (model_zoo / "Dockerfile").read_text()
    assert "FROM elasticdl-pytorch:0.1.0" in text
    assert text.index("requirements.txt") < text.index("COPY . /workspace/my_zoo")


def test_init_needs_a_directory(tmp_path, capsys):
    assert zoo.init(str(tmp_path / "absent")) == 2
    assert "not a directory" in capsys.readouterr().err


def test_no_docker_cli(model_zoo, tmp_path, monkeypatch, capsys):
    zoo.init(str(model_zoo))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert zoo.build("reg/z:v1", str(model_zoo)) == 2
    assert "docker CLI" in capsys.readouterr().err
    assert zoo.push("reg/z:v1") == 2
    assert "not installed" in capsys.readouterr().err


def test_docker_without_engine(model_zoo, tmp_path, monkeypatch, capsys):
    zoo.init(str(model_zoo))
    monkeypatch.setenv("PATH", fake_docker(tmp_path, (
        'echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. '
        'Is the docker daemon running?" >&2; exit 1')))
    assert zoo.build("reg/z:v1", str(model_zoo)) == 2
    err = capsys.readouterr().err
    assert "Docker engine is not reachable" in err and "Cannot connect" in err
    assert zoo.push("reg/z:v1") == 2
    assert "not reachable" in capsys.readouterr().err
    assert "build" not in (tmp_path / "calls.txt").read_text()  # never got that far


def test_build_and_push_drive_the_docker_cli(model_zoo, tmp_path, monkeypatch):
    zoo.init(str(model_zoo))
    monkeypatch.setenv("PATH", fake_docker(tmp_path, "exit 0"))
    assert zoo.build("reg/z:v1", str(model_zoo), build_args="A=1") == 0
    assert zoo.push("reg/z:v1") == 0
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls[1] == (f"build -t reg/z:v1 -f {model_zoo}{os.sep}Dockerfile --build-arg A=1 "
                        f"{model_zoo}")
    assert calls[3] == "push reg/z:v1"


def test_failed_build_and_missing_dockerfile(model_zoo, tmp_path, monkeypatch, capsys):
    assert zoo.build("reg/z:v1", str(model_zoo)) == 2
    assert "zoo init" in capsys.readouterr().err
    zoo.init(str(model_zoo))
    monkeypatch.setenv("PATH", fake_docker(tmp_path, '[ "$1" = info ] && exit 0; exit 3'))
    assert zoo.build("reg/z:v1", str(model_zoo)) == 1
    assert "docker build of reg/z:v1 failed" in capsys.readouterr().err
    assert zoo.push("reg/z:v1") == 1
    assert zoo.build("", str(model_zoo)) == 2
