"""Loading a user's model module and checking its contract.

``--model_def=digits.digits_cnn.custom_model`` with ``--model_zoo=model_zoo``
imports ``model_zoo/digits/digits_cnn.py`` and takes ``custom_model`` as the
model factory. The required functions (``loss``, ``optimizer``, ``feed``) and
the optional ones are looked up by the names the job spec gives; anything
missing or not callable is reported by name together with the module path,
before any training starts.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
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
    feed: Callable[..., Any]
    eval_metrics_fn: Optional[Callable[[], dict[str, Callable[..., Any]]]]
    custom_data_reader: Optional[Callable[..., Any]]
    prediction_outputs_processor: Optional[Any]
    train_loop: Optional[Callable[..., Any]]

    def build_model(self) -> Any:
        """Call the model factory; the result must be a ``torch.nn.Module``."""
        import torch

        model = self.model_factory(**self.model_kwargs)
        if not isinstance(model, torch.nn.Module):
            raise ModelSpecError(
                f"model factory {self.model_factory.__name__} in {self.module_path} returned "
                f"{type(model).__name__}, not a torch.nn.Module"
            )
        return model

    def metrics(self) -> dict[str, Callable[..., Any]]:
        """The metric functions, or ``{}`` when the module defines none."""
        if self.eval_metrics_fn is None:
            return {}
        metrics = self.eval_metrics_fn()
        if not isinstance(metrics, dict) or not all(callable(m) for m in metrics.values()):
            raise ModelSpecError(
                f"eval_metrics_fn in {self.module_path} must return a dict of "
                f"name -> callable(labels, outputs), got {metrics!r}"
            )
        return metrics


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
    spec = ModelSpec(
        module=module,
        module_path=path,
        model_factory=factory,
        model_kwargs=dict(model_kwargs or {}),
        loss=required(loss, "loss"),
        optimizer=required(optimizer, "optimizer"),
        feed=required(feed, "feed"),
        eval_metrics_fn=optional(eval_metrics_fn, "eval_metrics_fn"),
        custom_data_reader=optional(custom_data_reader, "custom_data_reader"),
        prediction_outputs_processor=optional(prediction_outputs_processor,
                                              "PredictionOutputsProcessor"),
        train_loop=optional(train_loop, "train_loop"),
    )
    _check_arity(spec.loss, 2, "loss", path)
    _check_arity(spec.feed, 2, "feed", path)
    _check_arity(spec.optimizer, 1, "optimizer", path)
    return spec


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
