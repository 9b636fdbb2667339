"""A fake :class:`WorkerRuntime`: a real implementation of the ABC whose "model"
is the running mean of the training labels (no torch optimiser, no PS, no
group). It polls with the shared :class:`TaskPoller`, feeds minibatches with
the model module's ``feed``, reports tasks and evaluations like the real
runtimes, exports ``fake_model.json`` and records what happened to it in
:data:`EVENTS` so tests can check the worker's calls in order."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from elasticdl.common.task import TaskType
from elasticdl.worker.poller import TaskPoller, minibatch_count, minibatch_slice
from elasticdl.worker.runtime import OnVersion, Readers, RuntimeContext, WorkerRuntime
from elasticdl.worker.task_loop import LoopStats
from elasticdl.worker.task_source import TaskSource

EVENTS: list[tuple[str, Any]] = []
FAIL_AFTER_STEPS = [0]  # >0: raise RuntimeError on that training step


class FakeRuntime(WorkerRuntime):
    def __init__(self, ctx: RuntimeContext):
        self.ctx = ctx
        self.mean = 0.0
        self.seen = 0
        self.version = 0

    @classmethod
    def build(cls, ctx: RuntimeContext) -> FakeRuntime:
        EVENTS.append(("build", (ctx.worker_id, ctx.ps_addrs)))
        return cls(ctx)

    @property
    def model_version(self) -> int:
        return self.version

    def run(self, source: TaskSource, readers: Readers, sink: Optional[Any] = None,
            on_version: Optional[OnVersion] = None) -> LoopStats:
        stats = LoopStats()
        poller = TaskPoller(source, wait_s=0.01, max_wait_s=30.0)
        mb = self.ctx.job_spec.minibatch_size
        feed = self.ctx.model_spec.feed
        while (task := poller.next_task()).type != TaskType.NONE:
            records = readers[task.type].read(task.shard_name, task.start, task.end)
            mode = "training" if task.type == TaskType.TRAINING else "evaluation"
            err, count = 0.0, 0
            for k in range(minibatch_count(len(records), mb)):
                _, labels = feed(records[minibatch_slice(k, len(records), mb)], mode)
                for y in labels.tolist():
                    if task.type == TaskType.TRAINING:
                        self.seen += 1
                        self.mean += (y - self.mean) / self.seen
                    else:
                        err, count = err + abs(y - self.mean), count + 1
                if task.type == TaskType.TRAINING:
                    self.version += 1
                    stats.steps += 1
                    if FAIL_AFTER_STEPS[0] and self.version == FAIL_AFTER_STEPS[0]:
                        raise RuntimeError(f"fake step {self.version} failed")
                    if on_version is not None:
                        on_version(self.version)
            if task.type == TaskType.EVALUATION and count:
                source.report_evaluation(task, [("mae", err / count, count)])
            source.report_task(task)
            stats.tasks += 1
        EVENTS.append(("run", stats.steps))
        return stats

    def export(self, directory: str) -> list[str]:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "fake_model.json")
        with open(path, "w") as f:
            json.dump(self.state_dict(), f)
        EVENTS.append(("export", path))
        return [path]

    def close(self) -> None:
        EVENTS.append(("close", self.version))

    def state_dict(self) -> dict[str, Any]:
        return {"model": {"mean": self.mean, "seen": self.seen}, "model_version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean = float(state["model"]["mean"])
        self.seen = int(state["model"]["seen"])
        self.version = int(state["model_version"])
