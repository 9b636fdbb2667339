"""A collapsed model: the watch counts steps whose outputs are identical for every
record of the minibatch, on a real network whose ReLUs are dead (issue 28)."""

from __future__ import annotations

import torch
from torch import nn

from elasticdl.worker.collapse import CollapseWatch, batch_output


def _net(dead: bool) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    if dead:   # every hidden unit negative for every input in [0, 1)^8: dead ReLUs
        with torch.no_grad():
            net[0].weight.abs_().neg_()
            net[0].bias.fill_(-1.0)
    return net


def test_dead_relus_give_identical_outputs_and_are_counted():
    watch = CollapseWatch()
    x = torch.rand(32, 8)
    watch.observe(_net(dead=True)(x), 32, version=7)
    watch.observe(_net(dead=False)(x), 32, version=8)
    watch.observe(_net(dead=True)(x[:16]), 16, version=9)
    assert watch.take() == {"collapsed_records": 48, "collapsed_at_version": 7,
                            "alive_at_version": 8}
    assert watch.take() == {}   # counted afresh


def test_a_healthy_model_and_outputs_without_rows_are_not_collapsed():
    watch = CollapseWatch()
    x = torch.rand(32, 8)
    watch.observe(_net(dead=False)(x), 32, 1)
    watch.observe(torch.zeros(()), 1, 2)              # a scalar: nothing to judge
    watch.observe(torch.zeros(1, 3), 1, 3)            # one row: nothing to judge
    watch.observe(torch.arange(4), 4, 4)              # integers: not judged
    assert watch.take() == {"alive_at_version": 1}
    # the first floating tensor of two rows or more in nested outputs is judged
    out = {"ids": torch.arange(4), "logits": torch.ones(4, 2)}
    assert batch_output(out) is out["logits"]
    watch.observe(out, 4, 5)
    assert watch.take() == {"collapsed_records": 4, "collapsed_at_version": 5}


def test_the_local_trainer_reports_collapsed_steps_of_a_dead_model(tmp_path):
    from elasticdl.api.model_spec import load_model_spec
    from elasticdl.worker.trainer import LocalTrainer

    module = tmp_path / "dead_mlp.py"
    module.write_text(
        "import torch\nfrom torch import nn\n\n"
        "def custom_model():\n"
        "    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))\n"
        "    with torch.no_grad():\n"
        "        net[0].weight.abs_().neg_()\n"
        "        net[0].bias.fill_(-1.0)\n"
        "    return net\n\n"
        "def loss(labels, outputs):\n"
        "    return nn.functional.cross_entropy(outputs, labels)\n\n"
        "def optimizer(params):\n"
        "    return torch.optim.SGD(params, lr=0.1)\n\n"
        "def feed(records, mode):\n"
        "    return records\n")
    spec = load_model_spec(str(tmp_path), "dead_mlp.custom_model")
    trainer = LocalTrainer(spec, torch.device("cpu"))
    for _ in range(3):
        trainer.train_minibatch(torch.rand(16, 8), torch.randint(0, 3, (16,)))
    # dead ReLUs get no gradient: the model stays collapsed, every step counted
    assert trainer.collapse_counters() == {"collapsed_records": 48, "collapsed_at_version": 0}
