"""The model of an evaluate or predict job, from ``--checkpoint_dir_for_init``.

A job output or PS checkpoint whose big tables are sparse (the rows that exist, see
:mod:`elasticdl.common.sparse_tables`) is loaded without materialising them: the model
is built inside ``tables_on_ps()``, those tables look their rows up in the exported ones
(:func:`elasticdl.api.sparse_export.attach_rows`), and everything else loads as usual.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from elasticdl.api.layers import tables_on_ps
from elasticdl.api.model_spec import ModelSpec
from elasticdl.api.sparse_export import attach_rows
from elasticdl.checkpoint import api as ckpt
from elasticdl.common.job_spec import JobSpec
from elasticdl.worker.trainer import LocalTrainer

logger = logging.getLogger(__name__)


def inference_trainer(model_spec: ModelSpec, spec: JobSpec,
                      device: torch.device) -> LocalTrainer:
    """A :class:`LocalTrainer` holding the model of ``spec.checkpoint_dir_for_init``."""
    path = spec.checkpoint_dir_for_init
    tables = ckpt.sparse_tables_for_inference(path, spec.export_sparse_min_elements)
    model: Optional[torch.nn.Module] = None
    if tables:
        torch.manual_seed(spec.seed)
        with tables_on_ps():
            model = model_spec.build_model()
        attach_rows(model, tables)
        logger.info("tables read as their exported rows: %s", ", ".join(
            f"{n} ({t.ids.shape[0]} of {t.spec.num_embeddings} rows)"
            for n, t in tables.items()))
    trainer = LocalTrainer(model_spec, device, spec.seed, model=model, amp=spec.amp,
                           clip_grad_norm=spec.clip_grad_norm)
    ckpt.load_for_inference(trainer, path, skip=set(tables))
    return trainer
