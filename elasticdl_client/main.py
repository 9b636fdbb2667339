"""The ``elasticdl`` command (python-fire).

``elasticdl train|evaluate|predict --flag=value ...`` builds a validated
:class:`~elasticdl.common.job_spec.JobSpec` and runs the job: in this process
(``--distribution_strategy=Local``), as local processes (``--cluster=local``),
or on Kubernetes (``--image_name=...``).

Exit codes: 0 success; 1 the job failed; 2 bad flags, model module or data.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import fire

from elasticdl.common.job_spec import JobSpec, JobSpecError, cli_fields, job_spec_from_flags
from elasticdl.common.log_utils import configure_logging

logger = logging.getLogger("elasticdl")

USAGE_ERROR = 2
JOB_FAILED = 1


class UsageError(Exception):
    """Bad input found before the job starts (exit code 2)."""


def _fail(command: str, message: str, code: int) -> None:
    print(f"elasticdl {command}: error: {message}", file=sys.stderr)
    sys.exit(code)


def _run_job(job_type: str, flags: dict[str, Any]) -> None:
    try:
        spec = job_spec_from_flags(job_type, flags)
    except JobSpecError as e:
        _fail(job_type, str(e), USAGE_ERROR)
        return
    configure_logging(spec.log_level)
    from elasticdl.api.model_spec import ModelSpecError
    from elasticdl.data.api import DataError

    try:
        report = _dispatch(spec)
    except (ModelSpecError, UsageError) as e:
        _fail(job_type, str(e), USAGE_ERROR)
        return
    except DataError as e:
        _fail(job_type, f"bad data: {e}", JOB_FAILED)
        return
    except KeyboardInterrupt:
        _fail(job_type, "interrupted", 130)
        return
    if report is not None and report.get("status") != "succeeded":
        failure = report.get("failure") or {}
        _fail(job_type, f"job {spec.job_name} {report.get('status')}: "
              f"{failure.get('error', 'see job_report.json')}", JOB_FAILED)


def _dispatch(spec: JobSpec) -> dict[str, Any] | None:
    if spec.distribution_strategy == "Local":
        if spec.cluster == "k8s":
            raise UsageError("--distribution_strategy=Local runs in this process; drop "
                             "--image_name/--cluster=k8s or pick a distributed strategy")
        from elasticdl.worker.local_job import run_local_job

        try:
            return run_local_job(spec)
        except Exception as e:  # the report already holds the traceback
            from elasticdl.api.model_spec import ModelSpecError
            from elasticdl.data.api import DataError

            if isinstance(e, (ModelSpecError, DataError)):
                raise
            logger.exception("job %s failed", spec.job_name)
            _fail(spec.job_type, f"job {spec.job_name} failed: {type(e).__name__}: {e}",
                  JOB_FAILED)
            return None
    raise UsageError(f"--distribution_strategy={spec.distribution_strategy} is not "
                     "available in this build yet")


def _flag_docs() -> str:
    groups: dict[str, list[str]] = {}
    for f in cli_fields():
        groups.setdefault(f.metadata["group"], []).append(f"  {f.name}: {f.metadata['help']}")
    lines = []
    for body in groups.values():
        lines.extend(body)
    return "\n".join(lines)


def _job_command(job_type: str, summary: str) -> Callable[..., None]:
    def command(**flags: Any) -> None:
        _run_job(job_type, flags)

    command.__name__ = job_type
    command.__doc__ = f"{summary}\n\nArgs:\n{_flag_docs()}\n"
    params = []
    for f in cli_fields():
        annotation = f.type if not isinstance(f.type, str) else {
            "int": int, "float": float, "bool": bool}.get(f.type, str)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                        default=f.default, annotation=annotation))
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return command


COMMANDS: dict[str, Any] = {
    "train": _job_command("train", "Train a model (Local, local processes or Kubernetes)."),
    "evaluate": _job_command("evaluate", "Evaluate a checkpoint on --validation_data."),
    "predict": _job_command("predict", "Predict --prediction_data with a checkpoint; one "
                            "output per input record in --output."),
}


def main(argv: list[str] | None = None) -> None:
    fire.Fire(COMMANDS, command=argv, name="elasticdl")


assert {f.name for f in dataclasses.fields(JobSpec)} >= {f.name for f in cli_fields()}

if __name__ == "__main__":
    main()
