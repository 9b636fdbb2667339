"""The ``elasticdl`` command (python-fire).

``elasticdl train|evaluate|predict --flag=value ...`` builds a validated
:class:`~elasticdl.common.job_spec.JobSpec` and runs the job: in this process
(``--distribution_strategy=Local``), as local processes (``--cluster=local``),
or on Kubernetes (``--image_name=...``).

Exit codes: 0 success; 1 the job failed; 2 bad flags, model module or data;
128 + N stopped by signal N (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP).

SIGTERM and SIGHUP stop a job as Ctrl-C does: the client stops the master (which
stops every PS and worker; they run in their own sessions, so signalling the
client's process group alone would miss them) and exits. A client killed by
SIGKILL leaves a ``--cluster=local`` job running: ``elasticdl status`` shows it
and ``elasticdl stop`` ends it.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from elasticdl.common.enums import ClusterKind, JobType
from elasticdl.common.job_spec import JobSpec, JobSpecError, cli_fields, job_spec_from_flags
from elasticdl.common.log_utils import configure_logging
from elasticdl.common.strategy import entry_for

logger = logging.getLogger("elasticdl")

USAGE_ERROR = 2
JOB_FAILED = 1


class UsageError(Exception):
    """Bad input found before the job starts (exit code 2)."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached the client: the job stops as on Ctrl-C (a
    KeyboardInterrupt, so every path that cleans up after Ctrl-C runs)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP raise :class:`Interrupted` in the main thread; the first
    one only (while the job is being stopped, more of them are ignored)."""
    def handler(signum: int, frame: Any) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


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
    stop_on_signals()
    from elasticdl.api.model_spec import ModelSpecError
    from elasticdl.common.advice import config_warnings, effective_batch_note
    from elasticdl.data.api import DataError
    from elasticdl.master.journal import JournalLockedError

    for warning in config_warnings(spec):
        logger.warning("%s", warning)
    if effective_batch_note(spec):
        logger.info("%s", effective_batch_note(spec))

    from elasticdl.checkpoint.paths import CheckpointError
    from elasticdl_client.model_check import LaunchCheckError, check_before_launch
    from elasticdl_client.remote_checkpoints import staged

    try:
        with staged(spec) as spec:   # checkpoint URLs: local staging, uploaded as written
            spec = check_before_launch(spec, in_process=runs_in_process(spec))
            report = _dispatch(spec)
    except (ModelSpecError, UsageError, LaunchCheckError, JournalLockedError,
            CheckpointError) as e:
        _fail(job_type, str(e), USAGE_ERROR)
        return
    except DataError as e:
        _fail(job_type, f"bad data: {e}", JOB_FAILED)
        return
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        _fail(job_type, f"interrupted ({signal.Signals(signum).name}): job {spec.job_name} "
              "stopped", 128 + signum)
        return
    if report is not None and report.get("status") == "succeeded_with_warnings":
        health = report.get("training_health") or {}
        if health.get("status") == "healthy" and health.get("restarts"):
            what = (f"training diverged and was rolled back {health['restarts']} time(s), "
                    "then trained healthy (--on_divergence=rollback")
        else:
            what = (f"training {health.get('status')}: {health.get('reason')} "
                    f"(--on_divergence={spec.on_divergence}")
        print(f"elasticdl {job_type}: warning: job {spec.job_name} succeeded with warnings: "
              f"{what}; see training_health in job_report.json)", file=sys.stderr)
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
    from elasticdl.local.job import run_local_job

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


def _rbac(namespace: str = "default") -> None:
    """Print the ServiceAccount, Role and RoleBinding the master pod needs."""
    from elasticdl_client import k8s  # not at import: a Local job never needs grpc/kubernetes

    code = k8s.rbac(namespace)
    if code:
        sys.exit(code)


COMMANDS["zoo"] = {"init": _zoo("init"), "build": _zoo("build"), "push": _zoo("push")}
COMMANDS["rbac"] = _rbac


def _scale():
    from elasticdl_client import scale

    return _exit_with(scale.scale)


COMMANDS["scale"] = _scale()
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


def parse_job_flags(args: list[str]) -> dict[str, Any] | None:
    """The flags of a job command (checked by :func:`check_job_flags`) as raw strings
    (``True``/``False`` for a bare ``--flag``/``--noflag``), which
    :func:`~elasticdl.common.job_spec.job_spec_from_flags` coerces to each field's type;
    None when fire must see the command line (``--help``, ``--`` and fire's flags).

    A job command does not need python-fire's parsing (and its import, ~0.2 s of CPU at
    every start of a Local job); its values reach the JobSpec unaltered (fire would
    read ``--job_name=007`` as the number 7)."""
    bools = {f.name for f in cli_fields() if f.type in (bool, "bool")}
    names = {f.name for f in cli_fields()}
    flags: dict[str, Any] = {}
    i = 0
    while i < len(args):
        tok = args[i]
        i += 1
        if tok in ("-h", "--help", "--") or not tok.startswith("--"):
            return None
        name, has_value, value = tok[2:].partition("=")
        name = name.replace("-", "_")
        if has_value:
            flags[name] = value
        elif name in names:
            if name not in bools and i < len(args) and not args[i].startswith("--"):
                flags[name], i = args[i], i + 1
            else:
                flags[name] = True
        elif name.startswith("no") and name[2:] in bools:
            flags[name[2:]] = False
        else:
            return None
    return flags


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("train", "evaluate", "predict"):
        try:
            check_job_flags(args[0], args[1:])
        except UsageError as e:
            _fail(args[0], str(e), USAGE_ERROR)
        flags = parse_job_flags(args[1:])
        if flags is not None:
            _run_job(args[0], flags)
            return
    import fire

    fire.Fire(COMMANDS, command=args, name="elasticdl")


assert {f.name for f in dataclasses.fields(JobSpec)} >= {f.name for f in cli_fields()}

if __name__ == "__main__":
    main()
