"""pytorch/examples word_language_model as an elasticdl model module: truncated
BPTT with the LSTM's hidden state carried across consecutive minibatches.

* records: the truncated-BPTT windows of gen_data.py (``[bptt + 1, batch]`` token
  rows); ``--minibatch_size=1`` is upstream's step (one window), more windows per
  minibatch make a longer window;
* ``init_state(features)``: the zero hidden state for the window's batch size;
  the framework calls ``RNNModel.forward(input, hidden)`` (the upstream class,
  unchanged) and carries the returned hidden state, detached, to the next
  minibatch of the stream (``repackage_hidden``; see
  elasticdl/worker/sequence_state.py and docs/training.md);
* SGD at lr 20 with ``--clip_grad_norm=0.25`` is upstream's update; the rate is
  divided by 4 when the validation loss does not improve: upstream's
  annealing is exactly ``ReduceLROnPlateau(factor=0.25, patience=0, threshold=0)``
  on the evaluation's ``loss``.

Run (Local)::

    python model_zoo/word_language_model/gen_data.py --out data/lm
    elasticdl train --model_zoo=model_zoo --model_def=word_language_model.lm.custom_model \\
        --training_data=data/lm/train --validation_data=data/lm/val --minibatch_size=1 \\
        --num_minibatches_per_task=50 --sequential_tasks --clip_grad_norm=0.25 \\
        --num_epochs=3 --distribution_strategy=Local
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from word_language_model.model import RNNModel

NTOKEN, EMSIZE, NHID, NLAYERS, DROPOUT, LR = 200, 64, 64, 2, 0.2, 20.0


def custom_model(ntoken: int = NTOKEN, emsize: int = EMSIZE, nhid: int = NHID,
                 nlayers: int = NLAYERS, dropout: float = DROPOUT) -> RNNModel:
    return RNNModel("LSTM", int(ntoken), int(emsize), int(nhid), int(nlayers), float(dropout))


def init_state(features: torch.Tensor, nhid: int = NHID, nlayers: int = NLAYERS):
    bsz = features.shape[1]
    zeros = torch.zeros(int(nlayers), bsz, int(nhid))
    return (zeros, zeros.clone())


def feed(records, mode: str):
    windows = [np.asarray(r) for r in records]
    data = np.concatenate([windows[0]] + [w[1:] for w in windows[1:]])   # consecutive
    data = torch.from_numpy(data.astype(np.int64))
    return data[:-1], data[1:].reshape(-1)


def loss(labels: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(outputs, labels)


def optimizer(params, lr: float = LR) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=float(lr))


def lr_scheduler(optimizer: torch.optim.Optimizer):
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode="min", factor=0.25, patience=0, threshold=0.0, threshold_mode="abs")
    return {"scheduler": sched, "monitor": "loss"}


def eval_metrics_fn():
    # the mean token cross-entropy (every window has bptt x batch tokens); its exp
    # is the perplexity
    return {"loss": lambda labels, outputs: float(F.nll_loss(outputs, labels))}
