"""What a model author imports: the model-module contract, ``layers.Embedding``,
and the elastic allreduce API for a custom ``train_loop(ctx)``.

The elastic runtime lives in :mod:`elasticdl.elastic`; the names here re-export
it. They are imported lazily (PEP 562), so importing ``elasticdl.api.model_spec``
(the master does) never imports torch.
"""

from typing import Any

_COLLECTIVE = "elasticdl.elastic.collective"
_STATE = "elasticdl.elastic.state"
_LAZY = {"all_gather": _COLLECTIVE, "all_reduce": _COLLECTIVE, "CollectiveError": _COLLECTIVE,
         "ElasticState": _STATE, "StepAborted": _STATE,
         "TrainLoopContext": "elasticdl.worker.elastic_dataset"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elasticdl.api' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
