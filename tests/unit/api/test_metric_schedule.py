"""A metric-driven lr_scheduler is accepted at load with a clear requirement (the
metric it monitors, --validation_data), or refused there with the module named:
never after an epoch (issue 23)."""

from __future__ import annotations

import itertools
import json
import textwrap

import pytest

from elasticdl.api.metric_schedule import check_replica, metric_rule
from elasticdl.api.model_spec import ModelSpecError, load_from_job_spec
from elasticdl.common.job_spec import job_spec_from_flags
from elasticdl.common.plateau import PlateauRule
from elasticdl_client.model_check import check_before_launch

MODULE = '''
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
    def forward(self, x):
        return self.fc(x)

def custom_model():
    return Net()

def loss(labels, outputs):
    return torch.nn.functional.cross_entropy(outputs, labels)

def optimizer(params):
    return torch.optim.SGD(params, lr=0.5)

def feed(records, mode):
    return torch.zeros(len(records), 2), torch.zeros(len(records), dtype=torch.long)

def eval_metrics_fn():
    return {"accuracy": lambda labels, outputs: 1.0}

class MetricStepLR:
    """Not a ReduceLROnPlateau, but its step takes a metric."""
    def __init__(self, optimizer):
        self.optimizer = optimizer
    def step(self, metrics):
        pass
    def state_dict(self):
        return {}

def lr_scheduler(optimizer):
    %s
'''

PLATEAU = ('return {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, '
           'mode="max", factor=0.3, patience=2, cooldown=1), "monitor": %r}')


_IDS = itertools.count()


def _spec(tmp_path, body: str, **flags):
    zoo = tmp_path / "zoo"
    zoo.mkdir(exist_ok=True)
    name = f"plateau_mod_{next(_IDS)}"   # a fresh module each time (imports are cached)
    (zoo / f"{name}.py").write_text(textwrap.dedent(MODULE % body))
    base = {"model_zoo": str(zoo), "model_def": f"{name}.custom_model",
            "training_data": "/nonexistent", "validation_data": "/nonexistent/val",
            "cluster": "local", "distribution_strategy": "ParameterServerStrategy",
            "num_workers": 2, "num_ps_pods": 1}
    base.update(flags)
    if base["distribution_strategy"] == "Local":
        base.pop("num_workers")
    return job_spec_from_flags("train", base)


def test_plateau_rule_reaches_the_master(tmp_path):
    spec = check_before_launch(_spec(tmp_path, PLATEAU % "accuracy"))
    rule = PlateauRule.from_json(spec.lr_plateau)
    assert (rule.monitor, rule.mode, rule.factor, rule.patience, rule.cooldown) == \
        ("accuracy", "max", 0.3, 2, 1)
    assert rule.initial_lrs == (0.5,)
    assert json.loads(spec.to_json())["lr_plateau"] == spec.lr_plateau


def test_plateau_without_monitor_names_what_to_return(tmp_path):
    with pytest.raises(ModelSpecError, match="takes a metric.*'monitor'"):
        check_before_launch(_spec(tmp_path, "return torch.optim.lr_scheduler."
                                            "ReduceLROnPlateau(optimizer)"))


@pytest.mark.parametrize("strategy", ["ParameterServerStrategy", "AllreduceStrategy", "Local"])
def test_plateau_without_validation_data_fails_at_load(tmp_path, strategy):
    spec = _spec(tmp_path, PLATEAU % "accuracy", validation_data="",
                 distribution_strategy=strategy)
    with pytest.raises(ModelSpecError, match="--validation_data"):
        metric_rule(load_from_job_spec(spec), spec)


def test_local_job_fails_before_training_without_evaluations(tmp_path):
    from elasticdl.local.job import LocalJob

    spec = _spec(tmp_path, PLATEAU % "accuracy", validation_data="",
                 distribution_strategy="Local")
    with pytest.raises(ModelSpecError, match="no evaluations"):
        LocalJob(spec)


def test_unknown_monitor_lists_the_metrics(tmp_path):
    with pytest.raises(ModelSpecError, match=r"'auc' is not a metric.*\['accuracy'\]"):
        check_before_launch(_spec(tmp_path, PLATEAU % "auc"))


def test_other_metric_scheduler_only_in_local(tmp_path):
    body = 'return {"scheduler": MetricStepLR(optimizer), "monitor": "accuracy"}'
    with pytest.raises(ModelSpecError, match="ReduceLROnPlateau's rule"):
        check_before_launch(_spec(tmp_path, body))
    spec = _spec(tmp_path, body, distribution_strategy="Local")
    assert metric_rule(load_from_job_spec(spec), spec) is None   # Local steps it itself


def test_monitor_on_a_plain_scheduler_is_refused(tmp_path):
    body = ('return {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1), '
            '"monitor": "accuracy"}')
    with pytest.raises(ModelSpecError, match="takes none"):
        check_before_launch(_spec(tmp_path, body))


def test_replica_refuses_a_spec_without_the_rule(tmp_path):
    spec = _spec(tmp_path, PLATEAU % "accuracy")      # not through the elasticdl command
    model_spec = load_from_job_spec(spec)
    with pytest.raises(ModelSpecError, match="no rule"):
        check_replica(model_spec, spec, model_spec.build_model())
    checked = check_before_launch(spec)
    check_replica(model_spec, checked, model_spec.build_model())
