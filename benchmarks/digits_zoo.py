"""A model zoo for the digits benchmarks: ``digits.digits_cnn`` with simulated GPU time.

``digits_delay.custom_model`` is the digits CNN whose loss sleeps
``$COUNT_RECORDS_DELAY_S`` per training minibatch (a GPU's step time, so that 2 CPU
cores can host 4 workers whose steps overlap as on a cluster) and whose Adam learning
rate is ``$DIGITS_LR`` (default the module's 3e-3). Used by ``elastic_scheduling.py``
and ``async_collapse.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DIGITS_DELAY = '''"""digits.digits_cnn with a sleep per training minibatch (GPU time) and
Adam's rate from $DIGITS_LR."""
import os
import time

import torch
from digits.digits_cnn import LEARNING_RATE, custom_model, eval_metrics_fn, feed  # noqa: F401
from digits.digits_cnn import loss as _loss

DELAY_S = float(os.environ.get("COUNT_RECORDS_DELAY_S", "0"))


def loss(labels, outputs):
    if DELAY_S and outputs.requires_grad:
        time.sleep(DELAY_S)
    return _loss(labels, outputs)


def optimizer(params):
    return torch.optim.Adam(params, lr=float(os.environ.get("DIGITS_LR", LEARNING_RATE)))
'''


def digits_zoo(work: str) -> tuple[str, str, str]:
    """A model zoo holding ``digits`` and ``digits_delay`` and the digits data, in
    ``work``: ``(zoo, train, val)``."""
    zoo = os.path.join(work, "zoo")
    if not os.path.isdir(zoo):
        for pkg in ("digits", "mnist"):   # digits_cnn builds on mnist_cnn
            shutil.copytree(os.path.join(ROOT, "model_zoo", pkg), os.path.join(zoo, pkg))
        with open(os.path.join(zoo, "digits_delay.py"), "w") as f:
            f.write(DIGITS_DELAY)
    data = os.path.join(work, "digits-data")
    if not os.path.isdir(os.path.join(data, "train")):
        subprocess.run([sys.executable, os.path.join(ROOT, "model_zoo", "digits",
                                                     "prepare_data.py"), f"--output={data}"],
                       check=True, stdout=subprocess.DEVNULL, timeout=300)
    return zoo, os.path.join(data, "train"), os.path.join(data, "val")
