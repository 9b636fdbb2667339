"""torchfm's DeepFM as published (``torchfm_dfm.py``, vendored unmodified: torch's own
``nn.Embedding`` tables of ``sum(field_dims)`` rows) on the 26 categorical fields of the
Criteo-shaped records; this module only supplies feed/loss/optimizer/metrics. Under
ParameterServerStrategy its two tables (``embedding.embedding``, ``linear.fc``) become
row-sharded PS tables (``--ps_table_min_elements``), untouched here.

``--model_params="sizes=N1-N2-...-N26;seed=0"``: the field sizes.
"""

from __future__ import annotations

import numpy as np
import torch

from ctr_zoo.ctr_module import columns, eval_metrics_fn, loss, optimizer  # noqa: F401
from ctr_zoo.torchfm_dfm import DeepFactorizationMachineModel


def build(sizes: list[int], seed: int = 0) -> DeepFactorizationMachineModel:
    torch.manual_seed(seed)
    return DeepFactorizationMachineModel(sizes, embed_dim=16, mlp_dims=(64, 64), dropout=0.0)


def custom_model(sizes: str = "", seed: int = 0) -> DeepFactorizationMachineModel:
    return build([int(s) for s in str(sizes).split("-")], seed)


def feed(records, mode):
    return batch(*columns(records))


def batch(dense, cat: np.ndarray, label: np.ndarray):
    """``(x,)``: DeepFM's forward takes the (batch, 26) field ids (no dense features)."""
    x = torch.from_numpy(np.ascontiguousarray(cat, dtype=np.int64))
    return (x,), torch.from_numpy(np.asarray(label, dtype=np.float32))
