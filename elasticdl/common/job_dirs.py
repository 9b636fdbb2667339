"""Where a job's files live on this machine.

A job's directory is ``--output`` when given, else
``$ELASTICDL_HOME/jobs/<job_name>`` (``ELASTICDL_HOME`` defaults to
``~/.elasticdl``). When ``--output`` is given, ``$ELASTICDL_HOME/jobs/<job_name>``
is a symlink to it, so ``elasticdl status|logs|stop <job>`` find every job by name.
"""

from __future__ import annotations

import os
from typing import Any


def elasticdl_home() -> str:
    return os.environ.get("ELASTICDL_HOME") or os.path.join(os.path.expanduser("~"),
                                                            ".elasticdl")


def named_job_dir(job_name: str) -> str:
    return os.path.join(elasticdl_home(), "jobs", job_name)


def job_dir_for(spec: Any) -> str:
    return spec.output or named_job_dir(spec.job_name)


def register_job_dir(spec: Any) -> str:
    """Create the job directory (and the by-name link); returns the directory."""
    directory = os.path.abspath(job_dir_for(spec))
    os.makedirs(directory, exist_ok=True)
    link = named_job_dir(spec.job_name)
    if os.path.abspath(link) != directory:
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if os.path.islink(link) or os.path.isfile(link):
            os.unlink(link)
        if not os.path.exists(link):
            os.symlink(directory, link)
    return directory
