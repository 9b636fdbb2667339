"""The ``elasticdl`` command (python-fire).

``elasticdl train|evaluate|predict --flag=value ...`` builds a validated
:class:`~elasticdl.common.job_spec.JobSpec` and runs the job: in this process
(``--distribution_strategy=Local``), as local processes (``--cluster=local``),
or on Kubernetes (``--image_name=...``).

Exit codes: 0 success; 1 the job failed; 2 bad flags, model module or data.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import fire

from elasticdl.common.enums import ClusterKind, JobType
from elasticdl.common.job_spec import JobSpec, JobSpecError, cli_fields, job_spec_from_flags
from elasticdl.common.log_utils import configure_logging
from elasticdl.common.strategy import entry_for

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
    from elasticdl.common.advice import config_warnings, effective_batch_note
    from elasticdl.data.api import DataError
    from elasticdl.master.journal import JournalLockedError

    for warning in config_warnings(spec):
        logger.warning("%s", warning)
    if effective_batch_note(spec):
        logger.info("%s", effective_batch_note(spec))

    from elasticdl_client.model_check import LaunchCheckError, check_before_launch

    try:
        spec = check_before_launch(spec, in_process=runs_in_process(spec))
        report = _dispatch(spec)
    except (ModelSpecError, UsageError, LaunchCheckError, JournalLockedError) as e:
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


def runs_in_process(spec: JobSpec) -> bool:
    """Local strategy: training in this process; evaluate/predict with one worker too."""
    if spec.cluster != ClusterKind.LOCAL or \
            not entry_for(spec.distribution_strategy).in_process_training:
        return False
    return spec.job_type == JobType.TRAIN or spec.num_workers == 1


def _dispatch(spec: JobSpec) -> dict[str, Any] | None:
    if spec.cluster == ClusterKind.K8S:
        if entry_for(spec.distribution_strategy).in_process_training and \
                spec.job_type == JobType.TRAIN:
            raise UsageError("--distribution_strategy=Local trains in this process; pick "
                             "ParameterServerStrategy or AllreduceStrategy for Kubernetes")
        from elasticdl_client import k8s

        code = k8s.submit(spec)
        if code:
            sys.exit(code)
        return None
    if not runs_in_process(spec):
        from elasticdl_client.local_cluster import run_local_cluster_job

        return run_local_cluster_job(spec)
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


def _job_op(op: str):
    def command(job_name: str, replica: str = "master", follow: bool = False,
                namespace: str = "default", cluster: str = "") -> None:
        from elasticdl_client import local_cluster

        try:
            local_dir = local_cluster.find_job(job_name) if cluster != ClusterKind.K8S else None
        except local_cluster.JobNotFound:
            local_dir = None
            if cluster == ClusterKind.LOCAL:
                _fail(op, f"no local job named {job_name!r}", USAGE_ERROR)
        if local_dir is None:
            from elasticdl_client import k8s

            if op == "logs":
                code = k8s.logs(job_name, replica=replica, namespace=namespace, follow=follow)
            else:
                code = getattr(k8s, op)(job_name, namespace=namespace)
            if code:
                sys.exit(code)
            return
        try:
            if op == "status":
                print(local_cluster.status(job_name))
            elif op == "logs":
                local_cluster.logs(job_name, replica, follow)
            else:
                print(local_cluster.stop(job_name))
        except local_cluster.JobNotFound as e:
            _fail(op, str(e), USAGE_ERROR)

    command.__name__ = op
    command.__doc__ = {
        "status": "Show a job's status: replicas, progress, metrics, relaunches.",
        "logs": "Print a replica's log (--replica=worker-1, default master; --follow).",
        "stop": "Stop a job and every process or pod it started.",
    }[op] + "\n\nArgs:\n  job_name: the job's name\n  replica: master, worker-N or ps-N" \
        "\n  follow: keep printing as the log grows\n  namespace: Kubernetes namespace" \
        "\n  cluster: local or k8s (default: local if such a local job exists)"
    return command


def _exit_with(fn):
    """Run a client function that returns an exit code, and exit with it."""
    def command(*args: Any, **kwargs: Any) -> None:
        code = fn(*args, **kwargs)
        if code:
            sys.exit(code)

    command.__name__ = fn.__name__
    command.__doc__ = fn.__doc__
    command.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    return command


def _zoo(name: str):
    from elasticdl_client import zoo

    return _exit_with(getattr(zoo, name))


def _rbac():
    from elasticdl_client import k8s

    return _exit_with(k8s.rbac)


COMMANDS["zoo"] = {"init": _zoo("init"), "build": _zoo("build"), "push": _zoo("push")}
COMMANDS["rbac"] = _rbac()
COMMANDS["status"] = _job_op("status")
COMMANDS["logs"] = _job_op("logs")
COMMANDS["stop"] = _job_op("stop")


def check_job_flags(command: str, args: list[str]) -> None:
    """Reject unknown flags and stray arguments of a job command *before* anything
    runs (python-fire would only complain after the command returned).

    Accepts ``--flag=value``, ``--flag value``, ``--flag`` and ``--noflag`` for
    boolean flags, and ``-`` for ``_`` in names, as fire does; stops at ``--``
    (fire's own flags follow). Raises :class:`UsageError` naming the flag and,
    for a near miss, the closest valid one.
    """
    fields = {f.name: f for f in cli_fields()}
    bools = {n for n, f in fields.items() if f.type in (bool, "bool")}
    i = 0
    while i < len(args):
        tok = args[i]
        i += 1
        if tok == "--":
            return
        if tok in ("-h", "--help"):
            continue
        if not tok.startswith("-"):
            raise UsageError(f"unexpected argument {tok!r}: flags are given as --name=value "
                             f"(see elasticdl {command} --help)")
        name, has_value = tok.lstrip("-").split("=", 1)[0].replace("-", "_"), "=" in tok
        if name in fields:
            if not has_value and name not in bools and i < len(args) and \
                    not args[i].startswith("--"):
                i += 1  # --flag value
            continue
        if name.startswith("no") and name[2:] in bools and not has_value:
            continue
        close = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.75)
        hint = f"; did you mean --{close[0]}?" if close else f" (see elasticdl {command} --help)"
        raise UsageError(f"unknown flag --{name}{hint}")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("train", "evaluate", "predict"):
        try:
            check_job_flags(args[0], args[1:])
        except UsageError as e:
            _fail(args[0], str(e), USAGE_ERROR)
    fire.Fire(COMMANDS, command=args, name="elasticdl")


assert {f.name for f in dataclasses.fields(JobSpec)} >= {f.name for f in cli_fields()}

if __name__ == "__main__":
    main()
