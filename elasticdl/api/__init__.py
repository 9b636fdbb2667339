"""What a model author imports: the model-module contract, ``layers.Embedding``,
and the elastic allreduce API for a custom ``train_loop(ctx)``: the
:class:`~elasticdl.api.train_loop.TrainLoopContext` interface (the worker implements it),
``all_gather`` / ``all_reduce`` / ``CollectiveError`` (:mod:`elasticdl.common.collective`),
``ElasticState`` and ``StepAborted`` (:mod:`elasticdl.common.elastic_state`).

They are imported lazily (PEP 562), so importing ``elasticdl.api.model_spec``
(the master does) never imports torch.
"""

from typing import Any

__all__ = ["CollectiveError", "ElasticState", "StepAborted", "TrainLoopContext", "all_gather",
           "all_reduce"]


def __getattr__(name: str) -> Any:
    if name in ("all_gather", "all_reduce", "CollectiveError"):
        from elasticdl.common import collective

        return getattr(collective, name)
    if name in ("ElasticState", "StepAborted"):
        from elasticdl.common import elastic_state

        return getattr(elastic_state, name)
    if name == "TrainLoopContext":
        from elasticdl.api.train_loop import TrainLoopContext

        return TrainLoopContext
    raise AttributeError(f"module 'elasticdl.api' has no attribute {name!r}")
