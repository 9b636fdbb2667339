"""The MNIST CNN with its own elastic training loop (AllreduceStrategy).

The CNN, ``feed``, ``loss`` and metrics are those of ``mnist.mnist_cnn``; this module
adds ``train_loop(ctx)``, which the allreduce worker calls instead of its built-in
loop::

    elasticdl train --model_zoo=model_zoo --model_def=mnist.mnist_custom_loop.custom_model \\
        --distribution_strategy=AllreduceStrategy --num_workers=3 \\
        --training_data=data/mnist/train --validation_data=data/mnist/val

What the loop shows:

* ``@ctx.step`` makes one training step elastic: if a member dies or joins, the
  step is retried on the re-formed group after model and optimizer were
  broadcast from the most advanced survivor;
* collectives (here a global accuracy with ``ctx.all_reduce``) live *inside* the
  step function, which every member runs every step — a member without data runs
  it on a filler batch, ``ctx.is_filler`` tells it to contribute nothing;
* intermediate gradients (``retain_grad``) work as usual;
* ``ctx.counters`` holds values that stay consistent across membership changes.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mnist.mnist_cnn import CNN, eval_metrics_fn, feed, loss, optimizer

__all__ = ["custom_model", "loss", "optimizer", "feed", "eval_metrics_fn", "train_loop"]

logger = logging.getLogger(__name__)

LOG_EVERY = 50


def custom_model() -> nn.Module:
    return CNN()


def train_loop(ctx: Any) -> None:
    """Train on ``ctx.dataset`` (every epoch of the master's tasks)."""
    model, opt = ctx.model, ctx.optimizer
    model.train()
    ctx.counters.setdefault("steps", 0)

    @ctx.step
    def train_step(features: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        features, labels = features.to(ctx.device), labels.to(ctx.device).long()
        opt.zero_grad()
        logits = model(features)
        logits.retain_grad()                   # inspect d(loss)/d(logits) after backward
        batch_loss = F.cross_entropy(logits, labels)
        batch_loss.backward()                  # gradient buckets all-reduced meanwhile
        opt.step()
        # global accuracy of this step; a filler batch (idle member) counts for nothing
        weight = 0.0 if ctx.is_filler else 1.0
        correct = (logits.argmax(dim=1) == labels).sum().float()
        sums = ctx.all_reduce(torch.stack([correct * weight,
                                           torch.tensor(float(len(labels)) * weight,
                                                        device=ctx.device)]))
        return {"loss": batch_loss.detach(), "accuracy": float(sums[0] / sums[1]),
                "logit_grad_norm": float(logits.grad.norm())}

    for features, labels in ctx.dataset:
        out: Optional[dict[str, Any]] = train_step(features, labels)
        if out is None:  # accumulating, or the step took effect before a failure
            continue
        ctx.counters["steps"] += 1
        if ctx.rank == 0 and ctx.counters["steps"] % LOG_EVERY == 0:
            logger.info("version %d (epoch %d, %d members): loss %.4f, global accuracy "
                        "%.3f, |dL/dlogits| %.4f", ctx.model_version, ctx.epoch,
                        ctx.world_size, float(out["loss"]), out["accuracy"],
                        out["logit_grad_norm"])
