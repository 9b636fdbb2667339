"""What the elastic runner works on and hands back: the state broadcast after a
membership change (:class:`ElasticState`), a round's inputs
(:class:`Microbatch`) and outcome (:class:`RoundResult`), and
:class:`StepAborted`. See :mod:`elasticdl.elastic.runner` for the rounds. Shared by the
elastic runtime and model authors (``elasticdl.api.ElasticState``), hence here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class StepAborted(RuntimeError):
    """Steps this worker already returned from were lost in a membership change.

    Raised by :meth:`AllreduceTrainer.train_minibatch` (the plain-Trainer path)
    after this worker had to join the group again: the ``lost`` most recent
    minibatches it trained since the last confirmation are not in the model any
    more and must be trained again. The elastic dataset path handles this
    itself.
    """

    def __init__(self, lost: int):
        super().__init__(f"{lost} unconfirmed step(s) lost in a membership change")
        self.lost = lost


class ElasticState:
    """Model, optimizer and counters, broadcast from a survivor after each change.

    ``counters`` holds plain values (and tensors) that must stay consistent
    across members — epoch, samples seen, anything the loop counts. ``register``
    adds objects with ``state_dict``/``load_state_dict`` (an LR scheduler, a
    GradScaler) to what is broadcast.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 **counters: Any):
        self.model = model
        self.optimizer = optimizer
        self.counters: dict[str, Any] = dict(counters)
        self.model_version = 0
        self._extras: dict[str, Any] = {}

    def register(self, name: str, obj: Any) -> None:
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"{name}: {type(obj).__name__} has no state_dict/load_state_dict")
        self._extras[name] = obj

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "counters": dict(self.counters), "model_version": self.model_version,
                "extras": {k: v.state_dict() for k, v in self._extras.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.counters.clear()
        self.counters.update(state.get("counters", {}))
        self.model_version = int(state.get("model_version", 0))
        for name, sub in state.get("extras", {}).items():
            if name in self._extras:
                self._extras[name].load_state_dict(sub)


class RoundStatus(enum.Enum):
    STEPPED = "stepped"   # the model advanced by one step (here or, before a failure, elsewhere)
    IDLE = "idle"         # no member had data
    DONE = "done"         # a member is leaving because the master has no more tasks


@dataclass
class RoundResult:
    status: RoundStatus
    version: int
    outputs: list[Any] = field(default_factory=list)   # step fn results, one per own microbatch
    tags: list[Any] = field(default_factory=list)      # tags of own microbatches consumed
    recovered: bool = False   # the step took effect on another member before a failure


@dataclass(frozen=True)
class Microbatch:
    args: tuple[Any, ...]
    records: int
    tag: Any = None


StepFn = Callable[..., Any]
