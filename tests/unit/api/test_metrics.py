"""elasticdl.api.metrics and the worker's metric handling: AUC equals sklearn's
with ties, merging is order- and split-independent, states survive the bytes
they travel as, torchmetrics metrics work through the same path, plain metric
functions keep their per-task weighted mean, and --eval_minibatch_size is used."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from elasticdl.api import metrics
from elasticdl.common.task import Task, TaskType
from elasticdl.worker.eval_metrics import EvalMetrics, dump_states, load_states
from elasticdl.worker.task_loop import TaskLoop
from tests.unit.fakes import eval_module_spec

sk = pytest.importorskip("sklearn.metrics")


def tied(n: int, seed: int, bins: int = 10) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    scores = np.round(np.clip(0.3 * y + rng.normal(0.35, 0.25, n), 0, 1) * bins) / bins
    return y, scores.astype(np.float32)


@pytest.mark.parametrize("seed", range(5))
def test_auc_equals_sklearn_with_ties(seed):
    y, s = tied(500 + seed * 77, seed)
    assert len(np.unique(s)) < 20  # heavily tied
    m = metrics.AUC()
    for chunk in np.array_split(np.arange(len(y)), 7):
        m.update(torch.from_numpy(y[chunk]), torch.from_numpy(s[chunk]))
    assert abs(m.compute() - sk.roc_auc_score(y, s)) <= 1e-12


def test_auc_output_shapes_and_undefined_case():
    y, s = tied(200, 9)
    want = sk.roc_auc_score(y, s)
    for outputs in (torch.from_numpy(s)[:, None],
                    torch.stack([torch.zeros(200), torch.from_numpy(s)], 1),   # 2 classes
                    torch.from_numpy(s).to(torch.bfloat16)):
        m = metrics.AUC()
        m.update(torch.from_numpy(y), outputs)
        got = m.compute()
        if outputs.dtype == torch.bfloat16:  # bf16 rounds the scores: sklearn on those
            want_bf16 = sk.roc_auc_score(y, outputs.float().numpy())
            assert abs(got - want_bf16) <= 1e-12
        else:
            assert abs(got - want) <= 1e-12
    m = metrics.AUC()
    m.update(torch.ones(4), torch.rand(4))
    with pytest.raises(ValueError, match="undefined"):
        m.compute()
    with pytest.raises(ValueError, match="shape"):
        metrics.AUC().update(torch.ones(4), torch.rand(4, 3))


def test_merging_is_independent_of_split_and_order():
    y, s = tied(1000, 3)
    want = sk.roc_auc_score(y, s)
    values = set()
    for trial in range(6):
        rnd = random.Random(trial)
        cuts = sorted(rnd.sample(range(1, 1000), 8))
        parts = np.split(np.arange(1000), cuts)
        states = []
        for part in parts:  # one worker's task each
            m = metrics.AUC()
            m.update(torch.from_numpy(y[part]), torch.from_numpy(s[part]))
            states.append(load_states(dump_states({"auc": m.state()}))["auc"])
        rnd.shuffle(states)
        merged = metrics.AUC()
        merged.merge(states)
        values.add(merged.compute())
    assert len(values) == 1 and abs(values.pop() - want) <= 1e-12


def test_accuracy_and_mean():
    acc = metrics.Accuracy()
    acc.update(torch.tensor([0, 2, 1]), torch.tensor([[1.0, 0, 0], [0, 0, 1], [0, 0, 1]]))
    acc.update(torch.tensor([1.0, 0.0]), torch.tensor([0.7, 0.2]))
    other = metrics.Accuracy()
    other.update(torch.tensor([1.0]), torch.tensor([0.1]))
    acc.merge([other.state()])
    assert acc.compute() == pytest.approx(4 / 6)
    mean = metrics.Mean(lambda labels, outputs: (labels - outputs) ** 2)  # per record
    mean.update(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]))
    mean.update(torch.tensor([3.0]), torch.tensor([0.0]))
    assert mean.compute() == pytest.approx(14 / 3)
    scalar = metrics.Mean(lambda labels, outputs: ((labels - outputs) ** 2).mean())
    scalar.update(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]))
    scalar.update(torch.tensor([3.0]), torch.tensor([0.0]))
    assert scalar.compute() == pytest.approx(14 / 3)
    # called, a metric gives one minibatch's value and keeps its state
    assert acc(torch.tensor([1, 1]), torch.tensor([0.9, 0.2])) == 0.5
    assert acc.compute() == pytest.approx(4 / 6)


def _tasks(metric_map, y, s, cuts):
    """Evaluate ``cuts`` as tasks the way workers do: per task a state blob."""
    blobs, plain = [], []
    for part in np.split(np.arange(len(y)), cuts):
        em = EvalMetrics(metric_map())
        em.begin_task()
        for mb in np.array_split(part, 3):
            em.update(torch.from_numpy(y[mb]), torch.from_numpy(s[mb]), len(mb))
        p, blob = em.end_task()
        plain.append(p)
        blobs.append(blob)
    return blobs, plain


def test_torchmetrics_metric_through_the_same_path():
    tm = pytest.importorskip("torchmetrics")
    y, s = tied(600, 5)

    def metric_map():
        return {"tm_auc": tm.classification.BinaryAUROC(),   # "cat" states
                "tm_acc": tm.classification.BinaryAccuracy(),  # "sum" states
                "auc": metrics.AUC()}

    blobs, _ = _tasks(metric_map, y, s, [100, 250, 400])
    final = dict((n, v) for n, v, _ in EvalMetrics(metric_map()).finalize(blobs[::-1]))
    want = sk.roc_auc_score(y, s)
    assert abs(final["auc"] - want) <= 1e-12
    assert abs(final["tm_auc"] - want) <= 1e-6
    assert final["tm_acc"] == pytest.approx(np.mean((s > 0.5) == (y == 1)))


def test_plain_metric_functions_keep_the_weighted_mean():
    y, s = tied(300, 7)

    def metric_map():
        return {"mse": lambda labels, outputs: float(((labels - outputs) ** 2).mean())}

    blobs, plain = _tasks(metric_map, y.astype(np.float32), s, [120])
    assert blobs == [b"", b""]  # nothing stateful: nothing to merge
    for (name, value, weight), part in zip([p[0] for p in plain],
                                           np.split(np.arange(300), [120])):
        sizes = [len(mb) for mb in np.array_split(part, 3)]
        per_batch = [float(np.mean((y[mb] - s[mb]) ** 2))
                     for mb in np.array_split(part, 3)]
        assert name == "mse" and weight == len(part)
        assert value == pytest.approx(np.dot(per_batch, sizes) / len(part))


def test_unreadable_states_are_a_clear_error():
    with pytest.raises(ValueError, match="unreadable metric states"):
        load_states(b"not a torch save")


class _Trainer:
    device = torch.device("cpu")
    sequence = None   # no model state carried across minibatches (Trainer.sequence)

    def __init__(self):
        self.batches: list[int] = []

    def forward(self, features):
        self.batches.append(len(features))
        return features.float() / 100.0


class _Source:
    def __init__(self):
        self.reported = []

    def report_evaluation(self, task, metrics_, states=b""):
        self.reported.append((list(metrics_), states))

    def report_task(self, *args, **kwargs):
        pass


class _Reader:
    def read(self, name, start, end):
        return list(range(start, end))


def test_eval_minibatch_size_is_used_for_evaluation_and_prediction(tmp_path):
    spec = eval_module_spec(str(tmp_path), "evalmb")
    trainer, source = _Trainer(), _Source()
    loop = TaskLoop(source, trainer, spec, {TaskType.EVALUATION: _Reader()},  # type: ignore
                    minibatch_size=8, eval_minibatch_size=30)
    loop.run_task(Task(1, TaskType.EVALUATION, "v", 0, 100, -1, 3))
    assert trainer.batches == [30, 30, 30, 10]
    (plain, blob), = source.reported
    assert plain == [] and load_states(blob)["auc"]["pos"].sum() == 50
    predict = Task(4, TaskType.PREDICTION, "p", 0, 70)
    assert [done for done, _, _ in loop._minibatches(predict, list(range(70)))] == [30, 60, 70]
    train = Task(5, TaskType.TRAINING, "t", 0, 20)
    assert [done for done, _, _ in loop._minibatches(train, list(range(20)))] == [8, 16, 20]
    loop = TaskLoop(source, trainer, spec, {TaskType.EVALUATION: _Reader()},  # type: ignore
                    minibatch_size=8)  # 0: the training minibatch size
    trainer.batches.clear()
    loop.run_task(Task(2, TaskType.EVALUATION, "v", 0, 20, -1, 3))
    assert trainer.batches == [8, 8, 4]
