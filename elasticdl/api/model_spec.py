"""Loading a user's model module and checking its contract.

``--model_def=digits.digits_cnn.custom_model`` with ``--model_zoo=model_zoo``
imports ``model_zoo/digits/digits_cnn.py`` and takes ``custom_model`` as the
model factory. The required functions (``loss``, ``optimizer``, ``feed``) and
the optional ones (``eval_metrics_fn``, ``lr_scheduler``, ``train_loop``, ...)
are looked up by the names the job spec gives; anything missing or not
callable is reported by name together with the module path, before any
training starts.

How the framework calls them (one place, used by every strategy):

* ``optimizer(params)`` gets ``(name, parameter)`` pairs instead of bare
  tensors when its first argument is called ``named_params`` or
  ``named_parameters`` (name-based groups, e.g. no weight decay on biases).
* ``loss(labels, outputs)`` also gets ``model=`` when it accepts a ``model``
  keyword (auxiliary and regularisation losses).
* ``--model_params`` go to the model factory, and to every other contract
  function whose signature names them (or takes ``**kwargs``).
* ``lr_scheduler(optimizer)`` returns a ``torch.optim.lr_scheduler`` scheduler
  (stepped once per epoch) or ``{"scheduler": s, "interval": "epoch"|"step"}``;
  steps are global optimizer updates, epochs are the master's. A scheduler
  whose ``step`` takes a metric (``ReduceLROnPlateau``) is stepped at every
  evaluation with the metric named by ``{"scheduler": s, "monitor": name}``
  (one of ``eval_metrics_fn``'s names; see :mod:`elasticdl.api.metric_schedule`).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional


class ModelSpecError(ValueError):
    """The model module breaks the contract; the message names what and where."""


@dataclass(frozen=True)
class ModelSpec:
    """The user's functions, resolved and checked."""

    module: ModuleType
    module_path: str
    model_factory: Callable[..., Any]
    model_kwargs: dict[str, object]
    loss: Callable[..., Any]
    optimizer: Callable[..., Any]
    feed: Optional[Callable[..., Any]]
    eval_metrics_fn: Optional[Callable[[], dict[str, Callable[..., Any]]]]
    custom_data_reader: Optional[Callable[..., Any]]
    prediction_outputs_processor: Optional[Any]
    train_loop: Optional[Callable[..., Any]]
    lr_scheduler: Optional[Callable[..., Any]] = None
    dataset: Optional[Callable[..., Any]] = None
    collate_fn: Optional[Callable[..., Any]] = None

    def call(self, fn: Callable[..., Any], *args: Any, **extra: Any) -> Any:
        """``fn(*args, **extra, **model_params)`` with only the keywords ``fn`` accepts
        (``extra`` first: the framework's own keywords win over --model_params)."""
        kwargs = _accepted(fn, {**self.model_kwargs, **extra})
        return fn(*args, **kwargs)

    def build_model(self) -> Any:
        """Call the model factory; the result must be a ``torch.nn.Module``."""
        import torch

        model = self.call(self.model_factory)
        if not isinstance(model, torch.nn.Module):
            raise ModelSpecError(
                f"model factory {self.model_factory.__name__} in {self.module_path} returned "
                f"{type(model).__name__}, not a torch.nn.Module"
            )
        return model

    def make_optimizer(self, named_params: Iterable[tuple[str, Any]]) -> Any:
        """The module's optimizer over ``named_params`` (``(name, tensor)`` pairs);
        named pairs reach it only when it asks for them (see the module docs)."""
        import torch

        named = list(named_params)
        arg = named if wants_named_params(self.optimizer) else [p for _, p in named]
        opt = self.call(self.optimizer, arg)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ModelSpecError(f"optimizer in {self.module_path} returned "
                                 f"{type(opt).__name__}, not a torch.optim.Optimizer")
        return opt

    def make_lr_scheduler(self, optimizer: Any) -> Optional[LRSchedule]:
        """The module's scheduler over ``optimizer``, or None when it defines none."""
        if self.lr_scheduler is None:
            return None
        out = self.call(self.lr_scheduler, optimizer)
        interval, monitor = "epoch", ""
        if isinstance(out, dict):
            unknown = set(out) - {"scheduler", "interval", "monitor"}
            if "scheduler" not in out or unknown:
                raise ModelSpecError(
                    f"lr_scheduler in {self.module_path} returned a dict with keys "
                    f"{sorted(out)}; expected 'scheduler' and optionally 'interval' or "
                    "'monitor'")
            interval = out.get("interval", "epoch")
            monitor = out.get("monitor") or ""
            out = out["scheduler"]
            if not isinstance(monitor, str):
                raise ModelSpecError(f"lr_scheduler in {self.module_path}: 'monitor' must "
                                     f"be a metric name, got {monitor!r}")
        if interval not in ("epoch", "step"):
            raise ModelSpecError(f"lr_scheduler in {self.module_path}: interval must be "
                                 f"'epoch' or 'step', got {interval!r}")
        if steps_with_metric(out):
            if not monitor:
                raise ModelSpecError(
                    f"lr_scheduler in {self.module_path} returned {type(out).__name__}, whose "
                    "step() takes a metric: return {'scheduler': s, 'monitor': NAME} with "
                    "NAME one of eval_metrics_fn's metrics (it is stepped at every "
                    "evaluation with that metric; the job needs --validation_data)")
            interval = "evaluation"
        elif monitor:
            raise ModelSpecError(f"lr_scheduler in {self.module_path}: 'monitor' is for a "
                                 f"scheduler whose step() takes a metric; "
                                 f"{type(out).__name__}.step() takes none")
        if not (callable(getattr(out, "step", None)) and hasattr(out, "state_dict")):
            raise ModelSpecError(f"lr_scheduler in {self.module_path} returned "
                                 f"{type(out).__name__}, not a torch.optim.lr_scheduler "
                                 "scheduler (with step() and state_dict())")
        if getattr(out, "optimizer", optimizer) is not optimizer:
            raise ModelSpecError(f"lr_scheduler in {self.module_path} returned a scheduler "
                                 "of another optimizer than the one it was given")
        return LRSchedule(out, interval, monitor)

    def feed_batch(self, records: Any, mode: str) -> Any:
        """``feed(records, mode)`` (with the --model_params it accepts); without a
        ``feed`` (allowed with ``dataset``), :func:`split_batch` of the collated batch."""
        if self.feed is None:
            return split_batch(records, self.module_path)
        return self.call(self.feed, records, mode)

    def compute_loss(self, labels: Any, outputs: Any, model: Any) -> Any:
        """``loss(labels, outputs)``, with ``model=`` when the loss accepts it."""
        return self.call(self.loss, labels, outputs, model=model)

    def metrics(self) -> dict[str, Callable[..., Any]]:
        """The metric functions, or ``{}`` when the module defines none."""
        if self.eval_metrics_fn is None:
            return {}
        metrics = self.call(self.eval_metrics_fn)
        from elasticdl.api.metrics import is_stateful

        if not isinstance(metrics, dict) or \
                not all(callable(m) or is_stateful(m) for m in metrics.values()):
            raise ModelSpecError(
                f"eval_metrics_fn in {self.module_path} must return a dict of "
                f"name -> callable(labels, outputs) or stateful metric "
                f"(elasticdl.api.metrics), got {metrics!r}"
            )
        return metrics


def split_batch(batch: Any, where: str = "the model module") -> tuple[Any, Any]:
    """``(features, labels)`` of a collated batch when the module defines no ``feed``:
    a ``(features, labels)`` pair as it is; a dict (e.g. ``input_ids``, ``labels``) is
    the features (``model(**batch)``) and its ``"labels"`` entry, if any, the labels.

    Raises:
        ModelSpecError: the batch is neither (the module must define ``feed``).
    """
    from collections.abc import Mapping

    if isinstance(batch, Mapping):
        return batch, batch.get("labels")
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ModelSpecError(f"{where} defines no feed(batch, mode), and its dataset's "
                         f"collated batch is a {type(batch).__name__}, neither a "
                         "(features, labels) pair nor a dict: define feed")


@dataclass
class LRSchedule:
    """A module's scheduler and when it steps: once per ``"epoch"`` (the master's
    epochs), per ``"step"`` (global optimizer updates) or, for a scheduler whose
    step takes a metric, per ``"evaluation"`` with the ``monitor`` metric."""

    scheduler: Any
    interval: str = "epoch"
    monitor: str = ""


def steps_with_metric(scheduler: Any) -> bool:
    """Whether ``scheduler.step`` needs a metric (``ReduceLROnPlateau``, or any
    scheduler whose step has a required positional argument)."""
    try:
        from torch.optim.lr_scheduler import ReduceLROnPlateau

        if isinstance(scheduler, ReduceLROnPlateau):
            return True
    except ImportError:  # pragma: no cover - torch is a dependency of model loading
        pass
    step = getattr(scheduler, "step", None)
    if step is None:
        return False
    try:
        params = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in params)


class ScheduleClock:
    """When a module's scheduler steps, one rule for every strategy (the PS
    shards' :class:`~elasticdl.ps.schedule.ShardSchedule`, the Local and
    allreduce trainers' :class:`~elasticdl.worker.trainer.OptimizerExtras`):

    * ``"epoch"``: once per epoch crossed when a step of a newer epoch is next
      (:meth:`advance_epoch`; epochs are the master's and never go backwards);
    * ``"step"``: once after every optimizer update (:meth:`after_update`);
    * ``"evaluation"`` (a ``ReduceLROnPlateau``): Local steps the scheduler with
      the monitored metric at each evaluation (:meth:`step_metric`); a PS shard or
      an allreduce member applies the reductions the master decided
      (:meth:`catch_up_reductions`, see :mod:`elasticdl.common.plateau`).

    ``epoch`` (the epoch the schedule was last advanced to) and ``reductions``
    belong in the owner's checkpoints with the scheduler's state.
    """

    def __init__(self, schedule: Optional[LRSchedule]):
        self.schedule = schedule
        self.epoch = 0
        self.reductions = 0   # master-decided plateau reductions applied here

    def step_metric(self, value: float) -> None:
        """An evaluation's value of the monitored metric (in-process jobs)."""
        if self.interval == "evaluation":
            assert self.schedule is not None
            self.schedule.scheduler.step(value)

    def catch_up_reductions(self, reductions: int) -> bool:
        """The master decided ``reductions`` reductions so far: apply the missing
        ones to the optimizer's groups (torch's ``_reduce_lr`` arithmetic); whether
        any was applied. Counts never go back."""
        if self.interval != "evaluation" or reductions <= self.reductions:
            return False
        from elasticdl.common.plateau import reduce_lrs

        assert self.schedule is not None
        sched = self.schedule.scheduler
        groups = sched.optimizer.param_groups
        for _ in range(reductions - self.reductions):
            new = reduce_lrs([float(g["lr"]) for g in groups], float(sched.factor),
                             list(sched.min_lrs), float(sched.eps))
            for g, lr in zip(groups, new):
                g["lr"] = lr
        sched._last_lr = [float(g["lr"]) for g in groups]
        self.reductions = reductions
        return True

    @property
    def interval(self) -> str:
        return self.schedule.interval if self.schedule is not None else ""

    @property
    def scheduler(self) -> Optional[Any]:
        return self.schedule.scheduler if self.schedule is not None else None

    def advance_epoch(self, epoch: int) -> bool:
        """A step of ``epoch`` is next; whether an epoch scheduler stepped."""
        if epoch <= self.epoch:
            return False
        crossed, self.epoch = epoch - self.epoch, epoch
        if self.interval != "epoch":
            return False
        for _ in range(crossed):
            self._step()
        return True

    def after_update(self) -> None:
        """An optimizer update was applied (or skipped by a loss scaler)."""
        if self.interval == "step":
            self._step()

    def _step(self) -> None:
        assert self.schedule is not None
        with warnings.catch_warnings():
            # a new epoch's first step can come before any optimizer.step() (a PS
            # placeholder optimizer never steps, a loss scaler skips): intended
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*before.*")
            self.schedule.scheduler.step()


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The part of ``kwargs`` that ``fn``'s signature accepts by keyword."""
    if not kwargs:
        return {}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    ok = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in ok}


def wants_named_params(fn: Callable[..., Any]) -> bool:
    """Whether ``optimizer``'s first argument asks for ``(name, parameter)`` pairs."""
    try:
        first = next(iter(inspect.signature(fn).parameters), "")
    except (TypeError, ValueError):
        return False
    return first in ("named_params", "named_parameters")


def _import_module(model_zoo: str, module_name: str) -> ModuleType:
    zoo = os.path.abspath(model_zoo)
    if not os.path.isdir(zoo):
        raise ModelSpecError(f"--model_zoo {model_zoo!r} is not a directory")
    if zoo not in sys.path:
        sys.path.insert(0, zoo)
    rel = os.path.join(zoo, *module_name.split("."))
    if not (os.path.isfile(rel + ".py") or os.path.isdir(rel)):
        raise ModelSpecError(
            f"model module {module_name!r} not found: no {rel}.py under --model_zoo {zoo}"
        )
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ModelSpecError(f"cannot import model module {rel}.py: {e}") from e


def load_model_spec(
    model_zoo: str,
    model_def: str,
    model_kwargs: Optional[dict[str, object]] = None,
    loss: str = "loss",
    optimizer: str = "optimizer",
    feed: str = "feed",
    eval_metrics_fn: str = "eval_metrics_fn",
    custom_data_reader: str = "custom_data_reader",
    prediction_outputs_processor: str = "PredictionOutputsProcessor",
    train_loop: str = "train_loop",
    lr_scheduler: str = "lr_scheduler",
    dataset: str = "dataset",
    collate_fn: str = "collate_fn",
) -> ModelSpec:
    """Import the module named by ``model_def`` and check every function.

    Raises:
        ModelSpecError: the zoo or module is missing, fails to import, or a
            required function is missing or not callable (named in the message
            with the module's file path).
    """
    if "." not in model_def:
        raise ModelSpecError(f"--model_def must be module.factory, got {model_def!r}")
    module_name, factory_name = model_def.rsplit(".", 1)
    module = _import_module(model_zoo, module_name)
    path = getattr(module, "__file__", None) or module_name

    def required(name: str, what: str) -> Callable[..., Any]:
        obj = getattr(module, name, None)
        if obj is None:
            raise ModelSpecError(f"{path} defines no {what} function {name!r}")
        if not callable(obj):
            raise ModelSpecError(f"{path}: {what} {name!r} is not callable "
                                 f"(it is a {type(obj).__name__})")
        return obj

    def optional(name: str, what: str) -> Optional[Any]:
        obj = getattr(module, name, None)
        if obj is not None and not callable(obj):
            raise ModelSpecError(f"{path}: {what} {name!r} is not callable")
        return obj

    factory = required(factory_name, "model factory")
    dataset_fn = optional(dataset, "dataset")
    spec = ModelSpec(
        module=module,
        module_path=path,
        model_factory=factory,
        model_kwargs=dict(model_kwargs or {}),
        loss=required(loss, "loss"),
        optimizer=required(optimizer, "optimizer"),
        # with dataset(path, mode), feed is optional (see split_batch)
        feed=optional(feed, "feed") if dataset_fn is not None else required(feed, "feed"),
        eval_metrics_fn=optional(eval_metrics_fn, "eval_metrics_fn"),
        custom_data_reader=optional(custom_data_reader, "custom_data_reader"),
        prediction_outputs_processor=optional(prediction_outputs_processor,
                                              "PredictionOutputsProcessor"),
        train_loop=optional(train_loop, "train_loop"),
        lr_scheduler=optional(lr_scheduler, "lr_scheduler"),
        dataset=dataset_fn,
        collate_fn=optional(collate_fn, "collate_fn"),
    )
    _check_arity(spec.loss, 2, "loss", path)
    if spec.feed is not None:
        _check_arity(spec.feed, 2, "feed", path)
    if spec.dataset is not None:
        _check_arity(spec.dataset, 2, "dataset", path)
    if spec.collate_fn is not None:
        _check_arity(spec.collate_fn, 1, "collate_fn", path)
    _check_arity(spec.optimizer, 1, "optimizer", path)
    _check_model_params(spec)
    return spec


def _check_model_params(spec: ModelSpec) -> None:
    """Every --model_params key must reach some contract function (typos fail here)."""
    fns = [f for f in (spec.model_factory, spec.loss, spec.optimizer, spec.feed,
                       spec.eval_metrics_fn, spec.lr_scheduler, spec.custom_data_reader,
                       spec.train_loop, spec.dataset) if f is not None]
    unused = set(spec.model_kwargs)
    for fn in fns:
        unused -= set(_accepted(fn, spec.model_kwargs))
    if unused:
        raise ModelSpecError(
            f"--model_params {sorted(unused)} are accepted by no function of "
            f"{spec.module_path} (the model factory, loss, optimizer, feed, "
            "eval_metrics_fn, lr_scheduler, custom_data_reader, train_loop or dataset)")


def _check_arity(fn: Callable[..., Any], n: int, what: str, path: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C functions: nothing to check
    try:
        sig.bind(*([None] * n))
    except TypeError:
        raise ModelSpecError(
            f"{path}: {what} {getattr(fn, '__name__', fn)!r} must accept {n} positional "
            f"argument(s), its signature is {sig}"
        ) from None


def load_from_job_spec(spec: Any) -> ModelSpec:
    """Load the model module named by a :class:`~elasticdl.common.job_spec.JobSpec`."""
    return load_model_spec(
        spec.model_zoo,
        spec.model_def,
        model_kwargs=spec.model_kwargs,
        loss=spec.loss,
        optimizer=spec.optimizer,
        feed=spec.feed,
        eval_metrics_fn=spec.eval_metrics_fn,
        custom_data_reader=spec.custom_data_reader,
        prediction_outputs_processor=spec.prediction_outputs_processor,
    )
