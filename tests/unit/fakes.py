"""Fakes that are real implementations of the ABCs (no mocks)."""

from __future__ import annotations

from elasticdl.cluster.api import Cluster, Phase, ReplicaEvent, ReplicaSpec, ReplicaType


class ScriptedCluster(Cluster):
    """Records created replicas; tests push events as a timeline."""

    def __init__(self):
        self.created: list[ReplicaSpec] = []
        self.deleted: list[tuple[ReplicaType, int]] = []
        self.pending: list[ReplicaEvent] = []
        self.closed = False

    def endpoint(self, type, index):
        return 7000 + index, f"ps-{index}.svc:{7000 + index}"

    def create_replica(self, spec: ReplicaSpec) -> None:
        self.created.append(spec)
        self.pending.append(ReplicaEvent(spec.type, spec.index, Phase.RUNNING))

    def delete_replica(self, type, index) -> None:
        self.deleted.append((type, index))

    def poll_events(self, timeout_s):
        out, self.pending = self.pending, []
        return out

    def close(self):
        self.closed = True

    def names(self):
        return [s.name for s in self.created]


EVAL_MODULE = (
    "import torch\n"
    "from elasticdl.api import metrics\n"
    "def custom_model(): return torch.nn.Linear(1, 1)\n"
    "def loss(labels, outputs): return outputs.sum()\n"
    "def optimizer(params): return torch.optim.SGD(params, lr=0.1)\n"
    "def feed(records, mode):\n"
    "    x = torch.tensor(records)\n"
    "    return x, (x % 2)\n"
    "def eval_metrics_fn(): return {'auc': metrics.AUC()}\n")
"""A model module whose records are integers (label: odd) and whose metric is AUC."""


def eval_module_spec(directory: str, name: str):  # noqa: ANN201 - a ModelSpec
    """Write :data:`EVAL_MODULE` as ``<directory>/<name>.py`` and load its spec."""
    import os

    from elasticdl.api.model_spec import load_model_spec

    with open(os.path.join(directory, f"{name}.py"), "w") as f:
        f.write(EVAL_MODULE)
    return load_model_spec(directory, f"{name}.custom_model")
