"""The digits CNN of model_zoo/digits with timestamps for the chaos campaign.

Every process that trains appends ``<unix time> <event>`` lines to
``$CHAOS_TRACE_DIR/<pod name>.trace``: ``feed`` when a worker feeds a training
minibatch, ``step`` after every optimizer step (a worker's in allreduce, the
PS's shard update in PS mode). Nothing else differs from the zoo module.
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "model_zoo"))

from digits import digits_cnn as _base  # noqa: E402

custom_model = _base.custom_model
loss = _base.loss
eval_metrics_fn = _base.eval_metrics_fn

_TRACE_DIR = os.environ.get("CHAOS_TRACE_DIR", "")
_trace = None


def _record(event: str) -> None:
    global _trace
    if not _TRACE_DIR:
        return
    if _trace is None:
        name = os.environ.get("MY_POD_NAME", f"pid-{os.getpid()}")
        _trace = open(os.path.join(_TRACE_DIR, f"{name}.trace"), "a", buffering=1)
    _trace.write(f"{time.time():.6f} {event}\n")


def optimizer(params):
    opt = _base.optimizer(params)
    opt.register_step_post_hook(lambda *_: _record("step"))
    return opt


def feed(records, mode):
    if mode == "training":
        _record("feed")
    return _base.feed(records, mode)
