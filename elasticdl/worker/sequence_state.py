"""A model state carried across minibatches: stateful sequence models (truncated BPTT).

A model module opts in by defining ``init_state(features)`` (the state for a
minibatch with these features, e.g. an LSTM's zero hidden state for their batch
size). Its model is then called as ``model(features, state)`` (``*features`` for
a tuple, ``**features, state=`` for a dict) and returns ``(outputs, new_state)``;
``loss`` and the metrics get ``outputs`` as usual. After each minibatch the new
state is detached from the graph (``detach_state(state)`` when the module
defines one, else every tensor in it is detached): gradients stop at the
minibatch boundary, the values flow on, as in pytorch/examples
word_language_model's ``repackage_hidden``.

Which state a minibatch starts from (one per worker and task kind, training or
evaluation): the one the previous minibatch of the same task left, and across
tasks the one the previous task left when the new task continues it (same
shard, its first record right after the previous task's last); any other task
starts from ``init_state``. Tasks go out in data order unless ``--shuffle``, so a
Local job trains and evaluates each stream exactly as a plain truncated-BPTT
loop does (``--sequential_tasks`` refuses ``--shuffle`` and checks the module).
Under ParameterServerStrategy a worker's tasks are not consecutive in general:
each task then starts from ``init_state`` (long tasks, ``--num_minibatches_per_task``,
make that rare). AllreduceStrategy does not carry states (refused at start).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from elasticdl.common.task import Task, TaskType
from elasticdl.worker.nested import to_device

logger = logging.getLogger(__name__)


def _detach(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach()
    if isinstance(state, (list, tuple)):
        return type(state)(_detach(s) for s in state)
    if isinstance(state, dict):
        return {k: _detach(v) for k, v in state.items()}
    return state


class SequenceState:
    """The carried state of one worker (see the module docs)."""

    def __init__(self, init_state: Callable[[Any], Any],
                 detach_state: Optional[Callable[[Any], Any]] = None):
        self.init_state = init_state
        self.detach_state = detach_state or _detach
        self._kind = "train"
        self._state: dict[str, Any] = {}                     # kind -> state (or None)
        self._end: dict[str, tuple[str, int]] = {}           # kind -> (shard, end)
        self.resets = 0

    @classmethod
    def of_spec(cls, spec: Any) -> Optional[SequenceState]:
        """The state of ``spec``'s module, or None when it defines no ``init_state``
        (its ``--model_params`` reach ``init_state`` as they reach the model)."""
        init = getattr(spec.module, "init_state", None)
        if init is None:
            return None
        if not callable(init):
            raise TypeError(f"init_state in {spec.module_path} is not callable")
        detach = getattr(spec.module, "detach_state", None)
        return cls(lambda features: spec.call(init, features), detach)

    def begin_task(self, task: Task) -> None:
        """``task`` is next: keep the state if it continues the previous task of
        its kind, else start over."""
        self._kind = "train" if task.type == TaskType.TRAINING else "eval"
        if self._end.get(self._kind) != (task.shard_name, task.start):
            self._state[self._kind] = None
            self.resets += 1
        self._end[self._kind] = (task.shard_name, task.end)

    def call(self, model: torch.nn.Module, features: Any, device: torch.device) -> Any:
        """``model(features, state)``: the outputs; the new state is kept, detached."""
        state = self._state.get(self._kind)
        if state is None:
            state = to_device(self.init_state(features), device)
        if isinstance(features, dict):
            out = model(**features, state=state)
        elif isinstance(features, tuple):
            out = model(*features, state)
        else:
            out = model(features, state)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"{type(model).__name__} of a module with init_state must return "
                            f"(outputs, new_state), got {type(out).__name__}")
        outputs, new_state = out
        self._state[self._kind] = self.detach_state(new_state)
        return outputs
