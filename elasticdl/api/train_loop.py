"""``ctx``: what a model module's ``train_loop(ctx)`` receives (the elastic allreduce API).

A model module may define ``train_loop(ctx)`` (AllreduceStrategy, and Local as a one-member
group)::

    def train_loop(ctx):
        model, opt = ctx.model, ctx.optimizer

        @ctx.step                       # retried through membership changes
        def train_step(features, labels):
            opt.zero_grad()
            loss = F.cross_entropy(model(features), labels)
            loss.backward()             # gradients all-reduced by backward hooks
            opt.step()
            return loss

        for features, labels in ctx.dataset:    # minibatches of master tasks, all epochs
            loss = train_step(features, labels)  # None while accumulating / when retried

This is the interface; the worker implements it
(:class:`elasticdl.worker.elastic_dataset.ElasticLoopContext`, where the rules of steps,
filler batches and collectives are described). Importing this module does not import torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

    from elasticdl.common.elastic_state import ElasticState


class TrainLoopContext(ABC):
    """What a model module's ``train_loop(ctx)`` receives.

    Attributes:
        dataset: the minibatches of the master's training tasks, all epochs:
            ``for features, labels in ctx.dataset``.
        device: the device the model is on.
    """

    dataset: Iterable[Any]
    device: torch.device

    @property
    @abstractmethod
    def lr_scheduler(self) -> Optional[Any]:
        """The module's ``lr_scheduler``, stepped by the framework (every member
        alike: per epoch of the master, or after every global update); None when
        the module defines none."""

    @abstractmethod
    def autocast(self) -> Any:
        """``torch.autocast`` for ``--amp=bf16`` (a no-op context when off)."""

    @property
    @abstractmethod
    def step_epoch(self) -> int:
        """The agreed epoch of the current step, once its gradients are reduced
        (after ``backward()``): the same on every member, filler ones included."""

    @property
    @abstractmethod
    def state(self) -> ElasticState:
        """Model, optimizer and counters, broadcast from a survivor after each change."""

    @property
    @abstractmethod
    def model(self) -> torch.nn.Module:
        """The model (``ctx.state.model``)."""

    @property
    @abstractmethod
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer (``ctx.state.optimizer``)."""

    @property
    @abstractmethod
    def counters(self) -> dict[str, Any]:
        """Counts that must survive membership changes (``ctx.state.counters``)."""

    @property
    @abstractmethod
    def rank(self) -> int:
        """This member's rank in the current group."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Members of the current group."""

    @property
    @abstractmethod
    def model_version(self) -> int:
        """The model version (global updates applied)."""

    @property
    @abstractmethod
    def epoch(self) -> int:
        """The master's epoch of the minibatch ``ctx.dataset`` yielded last."""

    @property
    @abstractmethod
    def is_filler(self) -> bool:
        """True while the step function runs on a filler batch (weight 0): skip logging."""

    @abstractmethod
    def step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Make ``fn`` (one training step on one minibatch: zero_grad, forward,
        backward, optimizer step) elastic; usable as a decorator. The wrapper returns
        ``fn``'s result once the step ran, None while accumulating microbatches or when
        the step took effect on another member before a failure."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, local_grad: bool = False) -> list[torch.Tensor]:
        """:func:`elasticdl.common.collective.all_gather` on the current group (autograd)."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """:func:`elasticdl.common.collective.all_reduce` on the current group (autograd)."""
