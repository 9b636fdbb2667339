"""``elasticdl zoo init|build|push``: a job image for a model zoo.

``init`` writes ``<zoo>/Dockerfile``: the base image (by default the
framework image built from ``docker/Dockerfile``), ElasticDL (installed only
if the base lacks it), the zoo's ``requirements.txt`` when present, and the
zoo's files under ``/workspace/<zoo name>`` with ``/workspace`` as the working
directory, so a relative ``--model_zoo=<zoo name>`` means the same inside the
image as in the directory holding the zoo. ``build`` and ``push`` run the
docker CLI and fail with a clear message when it or its engine is missing.

Exit codes: 0 done; 1 docker ran and failed; 2 usage or environment (no zoo
directory, Dockerfile exists, docker CLI or engine unavailable).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from typing import Optional

logger = logging.getLogger(__name__)

OK, DOCKER_FAILED, USAGE = 0, 1, 2
DEFAULT_BASE_IMAGE = "elasticdl-pytorch:0.1.0"
DEFAULT_PACKAGE = "elasticdl-pytorch"
WORKDIR = "/workspace"
ENGINE_CHECK_TIMEOUT_S = 20.0

DOCKERIGNORE = """__pycache__/
*.pyc
.git/
.ipynb_checkpoints/
*.egg-info/
"""


def _error(command: str, message: str, code: int) -> int:
    print(f"elasticdl zoo {command}: error: {message}", file=sys.stderr)
    return code


def dockerfile_text(zoo_name: str, base_image: str = DEFAULT_BASE_IMAGE,
                    elasticdl_package: str = DEFAULT_PACKAGE,
                    has_requirements: bool = False) -> str:
    """The Dockerfile of a model zoo image (see the module docstring)."""
    lines = [
        "# Written by `elasticdl zoo init`; build with `elasticdl zoo build --image=NAME`.",
        f"FROM {base_image}",
        "ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1",
        "# ElasticDL: already in the framework image, installed here on any other base",
        f'RUN python -c "import elasticdl" 2>/dev/null || pip install "{elasticdl_package}"',
    ]
    if has_requirements:
        lines += [f"COPY requirements.txt {WORKDIR}/{zoo_name}/requirements.txt",
                  f"RUN pip install -r {WORKDIR}/{zoo_name}/requirements.txt"]
    lines += [f"COPY . {WORKDIR}/{zoo_name}",
              f"WORKDIR {WORKDIR}",
              f"ENV PYTHONPATH={WORKDIR}/{zoo_name}",
              ""]
    return "\n".join(lines)


def init(model_zoo: str = ".", base_image: str = DEFAULT_BASE_IMAGE,
         elasticdl_package: str = DEFAULT_PACKAGE, force: bool = False) -> int:
    """Write ``<model_zoo>/Dockerfile`` (and a ``.dockerignore`` if absent)."""
    zoo = os.path.abspath(model_zoo)
    if not os.path.isdir(zoo):
        return _error("init", f"--model_zoo={model_zoo} is not a directory", USAGE)
    path = os.path.join(zoo, "Dockerfile")
    if os.path.exists(path) and not force:
        return _error("init", f"{path} exists; pass --force to overwrite it", USAGE)
    name = os.path.basename(zoo.rstrip(os.sep))
    text = dockerfile_text(name, base_image, elasticdl_package,
                           os.path.isfile(os.path.join(zoo, "requirements.txt")))
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    ignore = os.path.join(zoo, ".dockerignore")
    if not os.path.exists(ignore):
        with open(ignore, "w", encoding="utf-8") as f:
            f.write(DOCKERIGNORE)
    print(f"wrote {path}\n  elasticdl zoo build --model_zoo={model_zoo} --image=REGISTRY/"
          f"{name}:v1\n  then train with --image_name=REGISTRY/{name}:v1 --model_zoo={name}")
    return OK


def _docker(command: str, docker: str) -> tuple[Optional[str], int]:
    """The docker CLI path once its engine answers, else (None, exit code)."""
    path = shutil.which(docker)
    if path is None:
        return None, _error(command, f"the docker CLI ({docker!r}) is not installed or not on "
                            "PATH; install Docker, or build the Dockerfile with another tool",
                            USAGE)
    try:
        probe = subprocess.run([path, "info", "--format", "{{.ServerVersion}}"],
                               capture_output=True, text=True, timeout=ENGINE_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, _error(command, f"the Docker engine did not answer `docker info` within "
                            f"{ENGINE_CHECK_TIMEOUT_S:.0f} s", USAGE)
    if probe.returncode != 0:
        detail = (probe.stderr or probe.stdout).strip().splitlines()
        return None, _error(command, "the Docker engine is not reachable (is the daemon "
                            "running? is DOCKER_HOST right?): "
                            f"{detail[-1] if detail else 'docker info failed'}", USAGE)
    return path, OK


def _run(argv: list[str], timeout_s: float) -> int:
    """Run docker with its output on our terminal; the exit code, 124 on timeout."""
    logger.info("running %s", " ".join(argv))
    try:
        return subprocess.run(argv, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        print(f"{argv[0]} {argv[1]} did not finish within {timeout_s:.0f} s", file=sys.stderr)
        return 124


def build(image: str, model_zoo: str = ".", docker: str = "docker",
          build_args: str = "", timeout_s: float = 7200.0) -> int:
    """``docker build -t IMAGE -f <zoo>/Dockerfile <zoo>``."""
    if not image:
        return _error("build", "--image is required (e.g. registry/digits:v1)", USAGE)
    dockerfile = os.path.join(os.path.abspath(model_zoo), "Dockerfile")
    if not os.path.isfile(dockerfile):
        return _error("build", f"no {dockerfile}; run `elasticdl zoo init "
                      f"--model_zoo={model_zoo}` first", USAGE)
    path, code = _docker("build", docker)
    if path is None:
        return code
    argv = [path, "build", "-t", image, "-f", dockerfile]
    for arg in (a for a in build_args.split(",") if a):
        argv += ["--build-arg", arg]
    argv.append(os.path.dirname(dockerfile))
    if _run(argv, timeout_s) != 0:
        return _error("build", f"docker build of {image} failed (see its output above)",
                      DOCKER_FAILED)
    print(f"built {image}; push it with `elasticdl zoo push --image={image}`")
    return OK


def push(image: str, docker: str = "docker", timeout_s: float = 3600.0) -> int:
    """``docker push IMAGE``."""
    if not image:
        return _error("push", "--image is required", USAGE)
    path, code = _docker("push", docker)
    if path is None:
        return code
    if _run([path, "push", image], timeout_s) != 0:
        return _error("push", f"docker push of {image} failed (logged in to the registry? "
                      "`docker login`)", DOCKER_FAILED)
    print(f"pushed {image}")
    return OK
