"""What the rest of elasticdl calls to save, find, load and export checkpoints.

* :func:`save` / :func:`load`: a single-writer checkpoint (Local and allreduce:
  model, optimizer, version, data position).
* :func:`latest`: the newest complete ``version-N`` directory, or None.
* :func:`export_model`: the final ``model.pt`` (a plain state dict a user loads
  without elasticdl) and, with ``--export_torchscript`` and when the model
  scripts, ``model_scripted.pt`` (a failure there is a warning, never an error).
* :func:`load_for_inference`: model weights from any layout (single writer or
  PS shards) into a trainer, for ``evaluate`` and ``predict`` jobs.

Every function raises :class:`CheckpointError` when nothing usable is where
it was asked for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Collection
from typing import Any, Optional

import torch

from elasticdl.checkpoint import single, staging
from elasticdl.checkpoint.paths import (
    CheckpointError,
    complete_versions,
    resolve,
    version_dir,
    version_of,
)

logger = logging.getLogger(__name__)

save = single.save_single
load = single.load_single
save_file = single.save_file

__all__ = ["CheckpointError", "complete_versions", "export_model", "latest",
           "load", "load_for_inference", "resolve", "save", "save_file", "version_dir",
           "version_of"]


def latest(checkpoint_dir: str) -> Optional[str]:
    """The newest complete version directory under ``checkpoint_dir``, or None."""
    versions = complete_versions(checkpoint_dir) if checkpoint_dir else []
    return version_dir(checkpoint_dir, versions[-1]) if versions else None


def export_model(model: torch.nn.Module, directory: str, torchscript: bool = False
                 ) -> list[str]:
    """Write ``model.pt`` (a plain state dict, the model's own keys) and, with
    ``torchscript`` (``--export_torchscript``), ``model_scripted.pt``; returns
    the paths written.

    TorchScript is an optional extra: any error in scripting or saving it (a
    model that does not compile, ``OSError`` from ``inspect`` on a class whose
    source is not available, as with Hugging Face ``transformers`` models, ...)
    is logged as a WARNING naming the cause and the job keeps ``model.pt``. An
    export never fails a trained job over TorchScript.

    Raises:
        OSError: ``model.pt`` itself could not be written (disk full, no permission).
    """
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, "model.pt")]
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    single.save_file(state, paths[0])
    if torchscript:
        scripted = _export_torchscript(model, os.path.join(directory, "model_scripted.pt"))
        if scripted:
            paths.append(scripted)
    logger.info("final model written to %s", ", ".join(paths))
    return paths


def _export_torchscript(model: torch.nn.Module, path: str) -> Optional[str]:
    """``path`` with the scripted model, or None (warned) when it cannot be made."""
    tmp = path + ".tmp"
    try:
        with warnings.catch_warnings():  # TorchScript is deprecated but still what users load
            warnings.simplefilter("ignore", DeprecationWarning)
            scripted = torch.jit.script(model.cpu())
            scripted.save(tmp)
        os.replace(tmp, path)
    # Deliberately broad: the scripted file is an optional extra next to model.pt, and
    # torch.jit raises whatever its frontend hits (RuntimeError, NotSupportedError,
    # OSError from inspect.getsource, TypeError, AttributeError ...). The warning names
    # it; model.pt is already written.
    except Exception as e:  # noqa: BLE001
        first = str(e).splitlines()[0] if str(e) else ""
        logger.warning("--export_torchscript: %s does not compile to TorchScript (%s%s); "
                       "wrote model.pt (the state dict) only", type(model).__name__,
                       type(e).__name__, f": {first}" if first else "")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        return None
    return path


def load_for_inference(trainer: Any, path: str, skip: Collection[str] = ()) -> int:
    """Load model weights (and version) into ``trainer.model`` from a single-writer
    or PS checkpoint, or from a job's output (``--output``: its exported
    ``model.pt``, a plain state dict; the version its report names); returns the
    model version. Tables in ``skip`` (attached as rows, see
    :func:`sparse_tables_for_inference`) are not read whole from a PS checkpoint."""
    from elasticdl.common.job_report import exported_model_version

    exported = exported_model_version(path)
    if exported is not None:
        file = os.path.join(path, "model.pt")
        state = torch.load(file, map_location=str(trainer.device), weights_only=True)
        trainer.model.load_state_dict(state)
        trainer.model_version = exported
        logger.info("loaded exported model %s (model version %d)", file, exported)
        return exported
    vdir = resolve(path)
    staging.ensure(vdir)   # a staged checkpoint (object storage): its files come down
    if os.path.exists(os.path.join(vdir, "model.pt")):
        state = single.load_single(vdir, map_location=str(trainer.device))
        trainer.model.load_state_dict(state["model"])
        trainer.model_version = int(state.get("model_version", version_of(vdir)))
    else:
        from elasticdl.checkpoint.ps_shards import export_state_dict

        trainer.model.load_state_dict(export_state_dict(vdir, skip))
        trainer.model_version = version_of(vdir)
    return trainer.model_version


def sparse_tables_for_inference(path: str, min_elements: int) -> dict[str, Any]:
    """The tables an evaluate/predict job reads as their rows that exist
    (:class:`~elasticdl.common.sparse_tables.SparseRows` by table name): a job
    output's sparse export, or a PS checkpoint's lazy tables and those of at least
    ``min_elements`` elements; empty for anything else."""
    from elasticdl.common.job_report import exported_model_version
    from elasticdl.common.sparse_tables import has_sparse_export, read_tables

    if exported_model_version(path) is not None:
        return dict(read_tables(path)) if has_sparse_export(path) else {}
    vdir = resolve(path)
    staging.ensure(vdir)   # a staged checkpoint (object storage): its files come down
    if os.path.exists(os.path.join(vdir, "model.pt")):
        return {}
    from elasticdl.checkpoint.ps_shards import sparse_rows

    return dict(sparse_rows(vdir, min_elements))
