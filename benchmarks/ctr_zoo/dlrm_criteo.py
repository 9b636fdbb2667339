"""facebookresearch/dlrm's ``DLRM_Net`` as published (``dlrm_s_pytorch.py``, vendored
unmodified in this folder) on Criteo-shaped records: this module only supplies what
elasticdl asks of a model module (feed, loss, optimizer, metrics). The model code is
torch's own: 26 ``nn.EmbeddingBag(n, 16, mode="sum", sparse=True)`` tables; under
ParameterServerStrategy they become row-sharded PS tables (``--ps_table_min_elements``),
untouched here.

``--model_params="sizes=N1-N2-...-N26;seed=0"``: the table sizes (as
``criteo_gen.table_sizes``) and the seed of DLRM's numpy initialisation.
"""

from __future__ import annotations

import numpy as np
import torch

from ctr_zoo.criteo_gen import NUM_DENSE
from ctr_zoo.ctr_module import columns, eval_metrics_fn, loss, optimizer  # noqa: F401
from ctr_zoo.dlrm_s_pytorch import DLRM_Net

EMB_DIM = 16


def build(sizes: list[int], seed: int = 0) -> DLRM_Net:
    np.random.seed(seed)   # DLRM initialises with numpy's global generator
    ln_emb = np.array(sizes)
    ln_bot = np.array([NUM_DENSE, 64, EMB_DIM])
    num_int = (len(sizes) + 1) * len(sizes) // 2 + EMB_DIM   # dot interaction, as upstream
    ln_top = np.array([num_int, 64, 1])
    return DLRM_Net(m_spa=EMB_DIM, ln_emb=ln_emb, ln_bot=ln_bot, ln_top=ln_top,
                    arch_interaction_op="dot", arch_interaction_itself=False,
                    sigmoid_bot=-1, sigmoid_top=ln_top.size - 2, loss_function="bce")


def custom_model(sizes: str = "", seed: int = 0) -> DLRM_Net:
    return build([int(s) for s in str(sizes).split("-")], seed)


def feed(records, mode):
    """``(dense_x, lS_o, lS_i)`` as DLRM's forward takes them: one index tensor and one
    offsets tensor per table (one id per bag, as Criteo's one-hot fields)."""
    return batch(*columns(records))


def batch(dense: np.ndarray, cat: np.ndarray, label: np.ndarray):
    n = dense.shape[0]
    offsets = torch.arange(n, dtype=torch.int64)
    lS_i = [torch.from_numpy(np.ascontiguousarray(cat[:, f])) for f in range(cat.shape[1])]
    lS_o = [offsets for _ in lS_i]
    x = torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32))
    return (x, lS_o, lS_i), torch.from_numpy(np.asarray(label, dtype=np.float32))
