"""User-facing API: model spec, elastic allreduce, layers.

``elasticdl.api.all_gather`` / ``all_reduce`` are imported lazily (PEP 562), so
importing ``elasticdl.api.model_spec`` (the master does) never imports torch.
"""

from typing import Any

_LAZY = {"all_gather": "elasticdl.api.collective", "all_reduce": "elasticdl.api.collective",
         "CollectiveError": "elasticdl.api.collective", "ElasticState": "elasticdl.api.elastic",
         "StepAborted": "elasticdl.api.elastic"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elasticdl.api' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
