"""The model-module contract of issue 15, tested by its effect on a real step:
named parameters reach an optimizer that asks for them, ``loss`` gets ``model=``,
``--model_params`` reach feed/optimizer/lr_scheduler, and bad input fails clearly."""

from __future__ import annotations

import itertools
import textwrap

import pytest
import torch

from elasticdl.api.model_spec import ModelSpecError, load_model_spec
from elasticdl.worker.trainer import LocalTrainer

_ids = itertools.count()

HEADER = """
import torch
import torch.nn.functional as F
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x)

def custom_model():
    return Net()

def feed(records, mode):
    x = torch.tensor(records, dtype=torch.float32)
    return x, torch.zeros(len(records), 2)
"""


def _spec(tmp_path, body: str, **model_kwargs):
    name = f"contract_mod_{next(_ids)}"
    (tmp_path / f"{name}.py").write_text(HEADER + textwrap.dedent(body))
    return load_model_spec(str(tmp_path), f"{name}.custom_model", model_kwargs=model_kwargs)


RECORDS = [[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]]


def test_named_params_let_the_optimizer_leave_biases_undecayed(tmp_path):
    spec = _spec(tmp_path, """
        def loss(labels, outputs):
            return (outputs * 0.0).sum()          # no data gradient: only weight decay acts

        def optimizer(named_params):
            decay = [p for n, p in named_params if not n.endswith("bias")]
            no_decay = [p for n, p in named_params if n.endswith("bias")]
            return torch.optim.SGD([{"params": decay, "weight_decay": 0.5},
                                    {"params": no_decay, "weight_decay": 0.0}], lr=1.0)
    """)
    trainer = LocalTrainer(spec, torch.device("cpu"))
    w0 = trainer.model.fc.weight.detach().clone()
    b0 = trainer.model.fc.bias.detach().clone()
    trainer.train_minibatch(*spec.feed_batch(RECORDS, "training"))
    assert torch.equal(trainer.model.fc.bias.detach(), b0)        # not decayed
    torch.testing.assert_close(trainer.model.fc.weight.detach(), w0 * 0.5, rtol=0, atol=1e-7)


def test_loss_with_model_keyword_changes_the_gradient(tmp_path):
    spec = _spec(tmp_path, """
        def loss(labels, outputs, model=None):
            l2 = sum((p ** 2).sum() for p in model.parameters())
            return F.mse_loss(outputs, labels) + 0.1 * l2

        def optimizer(params):
            return torch.optim.SGD(params, lr=0.5)
    """)
    trainer = LocalTrainer(spec, torch.device("cpu"))
    ref = {k: v.detach().clone().requires_grad_(True)
           for k, v in trainer.model.named_parameters()}
    x, y = spec.feed_batch(RECORDS, "training")
    out = x @ ref["fc.weight"].T + ref["fc.bias"]
    plain = F_mse(out, y)
    (plain + 0.1 * sum((p ** 2).sum() for p in ref.values())).backward()
    trainer.train_minibatch(x, y)
    for k, p in trainer.model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[k].detach() - 0.5 * ref[k].grad,
                                   rtol=0, atol=1e-6)
    # and the L2 term made a difference: without it the step is another one
    grad_plain = torch.autograd.grad(F_mse(x @ ref["fc.weight"].T + ref["fc.bias"], y),
                                     ref["fc.weight"])[0]
    assert not torch.allclose(grad_plain, ref["fc.weight"].grad)


def F_mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(a, b)


def test_model_params_reach_feed_optimizer_and_lr_scheduler(tmp_path):
    spec = _spec(tmp_path, """
        def feed(records, mode, scale=1.0):
            x = torch.tensor(records, dtype=torch.float32) * scale
            return x, torch.zeros(len(records), 2)

        def loss(labels, outputs):
            return F.mse_loss(outputs, labels)

        def optimizer(params, lr=0.1):
            return torch.optim.SGD(params, lr=lr)

        def lr_scheduler(optimizer, gamma=0.5):
            return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=gamma)
    """, lr=0.3, gamma=0.25, scale=2.0)
    x, _ = spec.feed_batch(RECORDS, "training")
    assert torch.equal(x, torch.tensor(RECORDS) * 2.0)
    trainer = LocalTrainer(spec, torch.device("cpu"))
    assert trainer.optimizer.param_groups[0]["lr"] == 0.3
    trainer.start_task(type("T", (), {"epoch": 0})())
    trainer.train_minibatch(*spec.feed_batch(RECORDS, "training"))
    assert trainer.last_lr == 0.3
    trainer.start_task(type("T", (), {"epoch": 1})())
    trainer.train_minibatch(*spec.feed_batch(RECORDS, "training"))
    assert trainer.last_lr == pytest.approx(0.3 * 0.25, abs=1e-12)


def test_unknown_model_params_fail_naming_the_key(tmp_path):
    with pytest.raises(ModelSpecError, match="learning_rat"):
        _spec(tmp_path, """
            def loss(labels, outputs):
                return F.mse_loss(outputs, labels)

            def optimizer(params, lr=0.1):
                return torch.optim.SGD(params, lr=lr)
        """, learning_rat=0.3)


@pytest.mark.parametrize("body, message", [
    ("return {'interval': 'step'}", "expected 'scheduler'"),
    ("return {'scheduler': torch.optim.lr_scheduler.StepLR(optimizer, 1), 'interval': "
     "'batch'}", "interval must be 'epoch' or 'step'"),
    ("return 0.5", "not a torch.optim.lr_scheduler"),
    ("return torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter("
     "torch.zeros(1))], lr=1), 1)", "another optimizer"),
])
def test_malformed_lr_scheduler_returns_fail_clearly(tmp_path, body, message):
    spec = _spec(tmp_path, f"""
def loss(labels, outputs):
    return F.mse_loss(outputs, labels)

def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

def lr_scheduler(optimizer):
    {body}
""")
    with pytest.raises(ModelSpecError, match=message) as e:
        LocalTrainer(spec, torch.device("cpu"))
    assert "lr_scheduler" in str(e.value) and spec.module_path in str(e.value)
