"""DeepCTR-Torch's ``DeepFM`` as published (the ``deepctr-torch`` package from PyPI,
imported, not copied) on the Criteo-shaped records: 26 ``SparseFeat`` fields of
``embedding_dim`` 16 and 13 ``DenseFeat``, DNN (64, 64), its ``PredictionLayer``
(sigmoid). Its tables are torch's own ``nn.Embedding`` in ``nn.ModuleDict``s (one of dim
16 per field for the FM and the DNN, one of dim 1 per field for the linear part); under
ParameterServerStrategy those of at least ``--ps_table_min_elements`` become row-sharded
PS tables, untouched here. This module only supplies feed/loss/optimizer/metrics.

The model takes DeepCTR's one input: a float tensor of every feature side by side (the
field ids first, then the dense values), which it slices and casts back to ids itself.
The field ids are exact in float32 up to 2^24 rows a field.

``--model_params="sizes=N1-N2-...-N26;seed=0"``: the field sizes.
Requires ``pip install deepctr-torch`` (``torch>=2.4``, tqdm, scikit-learn; no
tensorflow). Importing it starts the package's own version check against pypi.org in a
thread; offline it prints one line and ends.
"""

from __future__ import annotations

import numpy as np
import torch

from ctr_zoo.criteo_gen import NUM_DENSE
from ctr_zoo.ctr_module import columns, eval_metrics_fn, loss, optimizer  # noqa: F401

EMB_DIM = 16


def build(sizes: list[int], seed: int = 0) -> torch.nn.Module:
    from deepctr_torch.inputs import DenseFeat, SparseFeat
    from deepctr_torch.models import DeepFM

    if max(sizes) > 1 << 24:
        raise ValueError(f"a field of {max(sizes)} ids: DeepCTR's float input holds ids "
                         "exactly only up to 2^24")
    torch.manual_seed(seed)
    columns = [SparseFeat(f"C{i}", vocabulary_size=n, embedding_dim=EMB_DIM)
               for i, n in enumerate(sizes)]
    columns += [DenseFeat(f"I{i}", 1) for i in range(NUM_DENSE)]
    return DeepFM(columns, columns, dnn_hidden_units=(64, 64), task="binary", seed=seed,
                  device="cpu")


def custom_model(sizes: str = "", seed: int = 0) -> torch.nn.Module:
    return build([int(s) for s in str(sizes).split("-")], seed)


def feed(records, mode):
    return batch(*columns(records))


def batch(dense: np.ndarray, cat: np.ndarray, label: np.ndarray):
    """``(x,)``: the (batch, 26 + 13) float input DeepCTR's models take."""
    x = np.concatenate([np.asarray(cat, dtype=np.float32),
                        np.asarray(dense, dtype=np.float32)], axis=1)
    return (torch.from_numpy(np.ascontiguousarray(x)),), \
        torch.from_numpy(np.asarray(label, dtype=np.float32))
