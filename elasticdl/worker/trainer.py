"""Running minibatches through a model: the part of a step that touches torch.

:class:`Trainer` is what the task loop drives, one minibatch at a time; the
worker's :class:`~elasticdl.worker.runtime.WorkerRuntime` owns one and runs it.
:class:`LocalTrainer` keeps the model and optimizer in this process (Local
strategy; allreduce builds on it); the parameter-server trainer pulls and
pushes around the same calls.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Optional

import torch

from elasticdl.api.model_spec import LRSchedule, ModelSpec, ModelSpecError, ScheduleClock
from elasticdl.worker.collapse import CollapseWatch
from elasticdl.worker.nested import to_device
from elasticdl.worker.sequence_state import SequenceState

logger = logging.getLogger(__name__)


def select_device(name: str, ordinal: int = 0) -> torch.device:
    """``auto`` picks CUDA when present; ``cuda`` without CUDA is an error.

    A CUDA device always has an index (``torch.cuda.set_device`` and NCCL's
    ``init_process_group(device_id=)`` refuse a bare ``cuda``): ``cuda`` and
    ``auto`` take GPU ``ordinal % device_count`` of the visible ones (the worker
    id: the workers of a local job on a multi-GPU machine spread over its GPUs;
    a pod sees its own GPUs from 0), ``cuda:N`` that one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"--device={name} but CUDA is not available on this machine")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", ordinal % torch.cuda.device_count())
    return device


def batch_size_of(labels: Any, features: Any) -> int:
    ref = labels if labels is not None else features
    while isinstance(ref, (Mapping, list, tuple)):
        ref = next(iter(ref.values())) if isinstance(ref, Mapping) else ref[0]
    return int(ref.shape[0]) if hasattr(ref, "shape") else len(ref)


class NonFiniteError(RuntimeError):
    """A step produced a NaN/Inf loss or gradient; the model was not updated.

    The task loop adds where it happened (:meth:`locate`), so the message that
    reaches the job report names the step, the task and, for a gradient, the
    parameter.
    """

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what
        self.where = ""

    def locate(self, where: str) -> NonFiniteError:
        self.where = where
        self.args = (f"{self.what} at {where}",)
        return self


def check_finite_loss(loss: torch.Tensor) -> None:
    """Raise :class:`NonFiniteError` if the (scalar) loss is NaN or Inf."""
    if not bool(torch.isfinite(loss.detach())):
        raise NonFiniteError(f"non-finite loss ({float(loss.detach())})")


def check_finite_grads(named_parameters: Any) -> None:
    """Raise :class:`NonFiniteError` naming the first parameter whose gradient
    holds a NaN or Inf. One fused 2-norm per tensor and one host sync: a 2-norm is
    finite only if every element is (on CPU it is ~20x cheaper than a max-abs
    pass, benchmarks/training_features.py); only when one is not (a NaN/Inf, or
    finite squares that overflowed) does the exact max-abs pass decide."""
    names, grads = [], []
    for name, p in named_parameters:
        if p.grad is not None:
            names.append(name)
            grads.append(p.grad.coalesce().values() if p.grad.is_sparse else p.grad)
    if not grads:
        return
    if bool(torch.isfinite(torch.stack(torch._foreach_norm(grads, 2.0))).all()):
        return
    finite = torch.isfinite(torch.stack(torch._foreach_norm(grads, float("inf"))))
    if bool(finite.all()):
        return
    i = int((~finite).nonzero()[0])
    raise NonFiniteError(f"non-finite gradient of parameter {names[i]!r} "
                         f"(shape {tuple(grads[i].shape)})")


AMP_MODES = ("off", "bf16", "fp16")


def check_amp(amp: str, device: torch.device) -> None:
    """Raise ``ValueError`` naming ``--amp`` when ``amp`` cannot run on ``device``."""
    if amp not in AMP_MODES:
        raise ValueError(f"--amp must be one of {AMP_MODES}, got {amp!r}")
    if amp == "fp16" and device.type != "cuda":
        raise ValueError(f"--amp=fp16 needs CUDA (float16 autocast with a GradScaler); this "
                         f"worker trains on {device.type}: use --amp=bf16 or --amp=off")


def autocast(amp: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for ``--amp`` (bf16 or fp16), a no-op context for ``off``."""
    if amp == "off":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


class OptimizerExtras(ScheduleClock):
    """What steps alongside an optimizer: the module's LR scheduler (stepped by
    the :class:`~elasticdl.api.model_spec.ScheduleClock` rule), a GradScaler
    (``--amp=fp16``) and ``--clip_grad_norm``. Its state (scheduler, epoch,
    scaler) goes into checkpoints and, under allreduce, into the state broadcast
    to members.
    """

    def __init__(self, schedule: Optional[LRSchedule], scaler: Optional[Any] = None,
                 clip_grad_norm: float = 0.0):
        super().__init__(schedule)
        self.scaler = scaler
        self.clip_grad_norm = float(clip_grad_norm)

    def clip(self, params: Any) -> None:
        if self.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"epoch": self.epoch, "lr_reductions": self.reductions}
        if self.schedule is not None:
            out["lr_scheduler"] = self.schedule.scheduler.state_dict()
        if self.scaler is not None:
            out["grad_scaler"] = self.scaler.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state.get("epoch", 0))
        self.reductions = int(state.get("lr_reductions", 0))
        if self.schedule is not None and "lr_scheduler" in state:
            self.schedule.scheduler.load_state_dict(state["lr_scheduler"])
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])


def call_model(model: torch.nn.Module, features: Any) -> Any:
    """Call ``model`` on what ``feed`` returned as features.

    A dict is spread as keywords (``model(**features)``, e.g. a ``transformers``
    model's ``input_ids=, attention_mask=, labels=``) and a tuple or list as
    positional arguments (``model(*features)``, e.g. ``forward(input, hidden)``)
    when ``forward``'s signature accepts them so; otherwise, and for anything else,
    it is passed whole (``model(features)``: a ``forward(self, features)`` that
    unpacks a tuple itself keeps working). Outputs are returned as the model gives
    them (a tensor, a tuple, a ``ModelOutput``...): the module's ``loss`` and
    metrics get them unchanged.
    """
    if isinstance(features, Mapping):
        if _spreads(type(model), model.forward, "kw", tuple(features)):
            return model(**features)
    elif isinstance(features, (tuple, list)):
        if _spreads(type(model), model.forward, "pos", len(features)):
            return model(*features)
    return model(features)


_SPREAD_CACHE: dict[tuple[Any, str, Any], bool] = {}


def _spreads(cls: type, forward: Any, kind: str, shape: Any) -> bool:
    """Whether ``forward`` binds the features spread (keywords ``shape``, or
    ``shape`` positional arguments); cached per model class."""
    key = (cls, kind, shape)
    hit = _SPREAD_CACHE.get(key)
    if hit is not None:
        return hit
    try:
        sig = inspect.signature(forward)
        if kind == "kw":
            sig.bind(**dict.fromkeys(shape))
        else:
            sig.bind(*([None] * shape))
        ok = True
    except TypeError:
        ok = False
    except ValueError:  # no signature (a builtin): the old contract, one argument
        ok = False
    if len(_SPREAD_CACHE) < 4096:
        _SPREAD_CACHE[key] = ok
    return ok


class Trainer(ABC):
    """One model replica's step interface: what the :class:`TaskLoop` drives.

    A trainer trains one minibatch (:meth:`train_minibatch`), computes outputs
    for evaluation and prediction (:meth:`forward`) and, for exactly-once
    training, hears where each step belongs (:meth:`start_task`,
    :meth:`set_position`, :meth:`finish_task`). It does not run tasks, export
    or close: that is the worker's :class:`~elasticdl.worker.runtime.WorkerRuntime`,
    which owns a trainer.
    """

    model: torch.nn.Module
    device: torch.device
    model_version: int
    spec: ModelSpec
    last_lr: Optional[float] = None   # the learning rate the last step was applied with
    amp: str = "off"                  # --amp: forward and loss under torch.autocast
    sequence: Optional[Any] = None    # a carried model state (worker/sequence_state.py)
    _collapse: Optional[CollapseWatch] = None   # this task's collapsed steps (worker/collapse.py)

    def _call(self, features: Any) -> Any:
        x = to_device(features, self.device)
        if self.sequence is not None:
            return self.sequence.call(self.model, x, self.device)
        return call_model(self.model, x)

    def compute_loss(self, features: Any, labels: Any) -> torch.Tensor:
        """Forward pass and the module's loss (under ``torch.autocast`` with
        ``--amp``); the loss must be a scalar tensor."""
        with autocast(self.amp, self.device):
            outputs = self._call(features)
            loss = self.spec.compute_loss(to_device(labels, self.device), outputs, self.model)
        if self._collapse is None:
            self._collapse = CollapseWatch()
        self._collapse.observe(outputs, batch_size_of(labels, features),
                               self.collapse_version())
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ModelSpecError(f"loss in {self.spec.module_path} must return a scalar "
                                 f"tensor, got {getattr(loss, 'shape', type(loss))}")
        check_finite_loss(loss)
        return loss

    def collapse_version(self) -> int:
        """The model version a step trains on (what ``collapsed_at_version`` reports)."""
        return int(self.model_version)

    def collapse_counters(self) -> dict[str, int]:
        """The training task's steps whose outputs were identical for every record
        (:mod:`elasticdl.worker.collapse`; empty: none), counted afresh from here."""
        return self._collapse.take() if self._collapse is not None else {}

    @abstractmethod
    def train_minibatch(self, features: Any, labels: Any) -> torch.Tensor:
        """One optimisation step; returns the loss (a detached tensor)."""

    # exactly-once hooks (ParameterServerStrategy overrides them)
    def start_task(self, task: Any) -> frozenset[int]:
        """1-based minibatches of a training task already applied (skipped)."""
        return frozenset()

    def set_position(self, task_id: int, minibatch: int,  # noqa: B027 - optional hook
                     num_records: int) -> None:
        """The identity of the next :meth:`train_minibatch`."""

    def finish_task(self, task: Any) -> dict[str, int]:
        """Counters reported with a training task (e.g. ``records_applied``)."""
        return {}

    def forward(self, features: Any) -> Any:
        """Outputs for evaluation or prediction, without gradients."""
        self.model.eval()
        with torch.no_grad():
            outputs = self._call(features)
        self.model.train()
        return outputs


class LocalTrainer(Trainer):
    """Model and optimizer in this process.

    Args:
        amp: ``--amp``: ``bf16`` autocast; ``fp16`` autocast and a GradScaler
            (CUDA only, ``ValueError`` otherwise).
        clip_grad_norm: ``--clip_grad_norm`` (0: off): the global norm of all
            gradients is clipped before every optimizer step.
    """

    def __init__(self, spec: ModelSpec, device: torch.device, seed: int = 0,
                 model: Optional[torch.nn.Module] = None, amp: str = "off",
                 clip_grad_norm: float = 0.0):
        check_amp(amp, device)
        torch.manual_seed(seed)
        self.spec = spec
        self.device = device
        self.amp = amp
        self.model = (model if model is not None else spec.build_model()).to(device)
        self.model.train()
        self.sequence = SequenceState.of_spec(spec)
        self.optimizer = spec.make_optimizer(self.model.named_parameters())
        scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None
        self.extras = OptimizerExtras(spec.make_lr_scheduler(self.optimizer), scaler,
                                      clip_grad_norm)
        self.model_version = 0

    @property
    def lr_scheduler(self) -> Optional[Any]:
        return self.extras.scheduler

    def start_task(self, task: Any) -> frozenset[int]:
        """A training task's steps are next: an epoch scheduler steps when its epoch
        is higher than the last one trained."""
        self.extras.advance_epoch(int(task.epoch))
        return frozenset()

    def train_minibatch(self, features: Any, labels: Any) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.compute_loss(features, labels)
        scaler = self.extras.scaler
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(self.optimizer)  # inf/nan: the scaler skips the step
        else:
            loss.backward()
            check_finite_grads(self.model.named_parameters())
        self.extras.clip(self.model.parameters())
        self.last_lr = float(self.optimizer.param_groups[0]["lr"])
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        self.extras.after_update()
        self.model_version += 1
        return loss.detach()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "model_version": self.model_version, "extras": self.extras.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.model_version = int(state.get("model_version", 0))
        if "extras" in state:
            self.extras.load_state_dict(state["extras"])
