"""Writing predictions exactly once per input record.

Each prediction task's outputs are written as one file named by the task's
shard and record range (``<file>.<start>-<end>.npz``) through a temp file and
a rename. A task redone after a worker died rewrites the same file, so every
input record has exactly one output, joinable back to the input by
(``source``, ``index``).

A model module can replace the default with a ``PredictionOutputsProcessor``
class whose ``process(predictions, shard_name, records_index, worker_id)`` is
called once per task; it should be idempotent per (shard, range) for the same
exactly-once guarantee.
"""

from __future__ import annotations

import csv
import inspect
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from elasticdl.common.task import Task


def _to_numpy(outputs: Sequence[Any]) -> np.ndarray:
    parts = []
    for out in outputs:
        if isinstance(out, (tuple, list)):
            out = out[0]
        if not isinstance(out, torch.Tensor) and isinstance(
                getattr(out, "logits", None), torch.Tensor):
            out = out.logits   # a transformers ModelOutput (or alike): its logits
        if isinstance(out, Mapping):
            raise TypeError("the default prediction writer handles tensor outputs (or "
                            "ModelOutput-like ones with .logits); define a "
                            "PredictionOutputsProcessor for dict outputs")
        parts.append(out.detach().cpu().numpy() if isinstance(out, torch.Tensor)
                     else np.asarray(out))
    return np.concatenate(parts) if parts else np.zeros((0,))


def prediction_file(output_dir: str, task: Task, ext: str) -> str:
    base = os.path.basename(task.shard_name)
    return os.path.join(output_dir, "predictions",
                        f"{base}.{task.start:010d}-{task.end:010d}.{ext}")


class PredictionSink:
    """Default writer (npz or csv) or the model module's processor."""

    def __init__(self, output_dir: str, fmt: str = "npz", processor_cls: Any = None):
        if fmt not in ("npz", "csv"):
            raise ValueError(f"prediction format must be npz or csv, got {fmt!r}")
        self.output_dir = output_dir
        self.fmt = fmt
        self.processor: Any = (processor_cls() if inspect.isclass(processor_cls)
                               else processor_cls)
        os.makedirs(os.path.join(output_dir, "predictions"), exist_ok=True)

    def write(self, task: Task, index: np.ndarray, outputs: Sequence[Any],
              worker_id: int) -> None:
        if self.processor is not None:
            self.processor.process(outputs, task.shard_name, index, worker_id)
            return
        values = _to_numpy(outputs)
        if len(values) != len(index):
            raise ValueError(f"model produced {len(values)} outputs for {len(index)} records "
                             f"of {task.shard_name}")
        path = prediction_file(self.output_dir, task, self.fmt)
        tmp = path + ".tmp"
        if self.fmt == "npz":
            with open(tmp, "wb") as f:
                np.savez(f, index=index, outputs=values,
                         source=np.array(task.shard_name))
        else:
            flat = values.reshape(len(values), -1)
            with open(tmp, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["source", "index"] + [f"output_{i}" for i in range(flat.shape[1])])
                for i, row in zip(index, flat):
                    w.writerow([task.shard_name, int(i)] + [f"{v:.7g}" for v in row])
        os.replace(tmp, path)


def read_predictions(output_dir: str) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """All ``(source, index, outputs)`` triples written by the default npz writer."""
    pred_dir = os.path.join(output_dir, "predictions")
    out = []
    for name in sorted(os.listdir(pred_dir)):
        if name.endswith(".npz"):
            with np.load(os.path.join(pred_dir, name)) as z:
                out.append((str(z["source"]), z["index"], z["outputs"]))
    return out
