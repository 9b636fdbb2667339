"""Checks in the ``elasticdl`` command, before any replica is launched.

A deterministic error in the model code (a missing function, a constructor that
raises, an ``Embedding`` option the strategy cannot honour, a ``train_loop`` for a
strategy that does not run it) or an impossible flag (``--amp=fp16`` without CUDA)
would otherwise surface only after the master started the PS and workers, tens
of seconds later and once per replica. :func:`check_before_launch` loads the
module and builds the model once, in this process, the way the job's replicas
will (under ParameterServerStrategy inside :func:`~elasticdl.api.layers.tables_on_ps`,
and each embedding table checked as the PS trainer would attach it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

from elasticdl.common.enums import ClusterKind, JobType, Strategy
from elasticdl.common.job_spec import JobSpec

logger = logging.getLogger(__name__)

DENSE_TABLE_WARN_ELEMENTS = 1 << 20   # a plain nn.Embedding this big under PS gets a warning


class LaunchCheckError(ValueError):
    """The job cannot run as configured; the message names the flag or function."""


def check_before_launch(spec: JobSpec, in_process: bool = False) -> JobSpec:
    """Check what would fail at every replica's start (``in_process``: the job
    runs in this process, which fails as fast by itself: flags only). Returns the
    spec to launch: with the module's metric-driven LR schedule rule for the
    master (``lr_plateau``, see :mod:`elasticdl.api.metric_schedule`).

    Raises:
        ModelSpecError: the module breaks the contract, building the model failed,
            it uses an option the strategy does not support, or it defines
            ``train_loop`` for a strategy that does not run it.
        LaunchCheckError: ``--amp=fp16`` on a local machine without CUDA, or a
            ``--checkpoint_dir`` holding an earlier run's checkpoints.
    """
    if spec.cluster == ClusterKind.LOCAL and spec.amp == "fp16" and spec.device != "cuda":
        from elasticdl.worker.trainer import check_amp, select_device

        try:  # the check every replica makes, on the device it would pick here
            check_amp(spec.amp, select_device(spec.device))
        except ValueError as e:
            raise LaunchCheckError(str(e)) from e
    if spec.job_type == JobType.TRAIN:
        from elasticdl.checkpoint.paths import CheckpointError, check_fresh_checkpoint_dir

        try:
            check_fresh_checkpoint_dir(spec.checkpoint_dir, spec.checkpoint_dir_for_init)
        except CheckpointError as e:
            raise LaunchCheckError(str(e)) from e
    if not in_process:
        return check_model(spec)
    return spec


def check_model(spec: JobSpec) -> JobSpec:
    """Load ``spec``'s model module and build its model once; ``spec`` with the
    module's metric-driven LR schedule rule (if any).

    Raises:
        ModelSpecError: the module breaks the contract, building the model failed,
            or it uses an option the job's strategy does not support.
    """
    from elasticdl.api.layers import Embedding, tables_on_ps
    from elasticdl.api.model_spec import ModelSpecError, load_from_job_spec

    if not os.path.isdir(spec.model_zoo):
        logger.info("model zoo %s is not on this machine; the model is checked by the job's "
                    "replicas", spec.model_zoo)
        return spec
    start = time.monotonic()
    model_spec = load_from_job_spec(spec)
    if spec.job_type == JobType.TRAIN:
        from elasticdl.worker.runtime import check_train_loop_supported

        check_train_loop_supported(model_spec, spec)
    on_ps = spec.distribution_strategy == Strategy.PS
    try:
        with tables_on_ps() if on_ps else contextlib.nullcontext():
            model = model_spec.build_model()
    except ModelSpecError:
        raise
    except Exception as e:  # re-raised as a usage error: the job must not start
        raise ModelSpecError(f"{model_spec.module_path}: building the model failed: "
                             f"{type(e).__name__}: {e}") from e
    import torch

    if on_ps:
        from elasticdl.api.torch_tables import TableSwapError, tables_to_ps

        try:  # as the PS trainer will (elasticdl.worker.ps_export.build_ps_model)
            tables_to_ps(model, spec.ps_table_min_elements)
        except TableSwapError as e:
            raise ModelSpecError(f"{model_spec.module_path}: {e}") from e
    for name, module in model.named_modules():
        where = f"{model_spec.module_path}: layer {name or '(model)'!r}"
        if on_ps and isinstance(module, Embedding):
            weight = module._parameters.get("weight")
            if weight is not None and not weight.requires_grad:
                raise ModelSpecError(f"{where}: a frozen Embedding (requires_grad=False) is "
                                     "not supported under ParameterServerStrategy")
            try:
                module.table_spec(f"{name}.weight" if name else "weight")
            except ValueError as e:
                raise ModelSpecError(f"{where}: {e}") from e
        if on_ps and isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and \
                module.weight.numel() >= DENSE_TABLE_WARN_ELEMENTS:
            logger.warning("%s: %s of %d x %d stays a dense parameter under "
                           "ParameterServerStrategy (every step pulls and pushes the whole "
                           "table): it is below --ps_table_min_elements=%d", where,
                           type(module).__name__, module.num_embeddings,
                           module.embedding_dim, spec.ps_table_min_elements)
    if spec.sequential_tasks and getattr(model_spec.module, "init_state", None) is None:
        raise ModelSpecError(f"--sequential_tasks: {model_spec.module_path} defines no "
                             "init_state(features) (the model state it carries)")
    from elasticdl.api.metric_schedule import metric_rule, with_metric_rule

    with tables_on_ps() if on_ps else contextlib.nullcontext():
        spec = with_metric_rule(spec, metric_rule(model_spec, spec, model))
    logger.info("model of %s built and checked in %.1f s", model_spec.module_path,
                time.monotonic() - start)
    return spec
