import os

import pytest
import torch

from elasticdl.api.model_spec import ModelSpecError, load_model_spec
from tests.conftest import FIXTURE_ZOO, MODEL_ZOO


def test_loads_digits_module():
    spec = load_model_spec(MODEL_ZOO, "digits.digits_cnn.custom_model")
    model = spec.build_model()
    assert isinstance(model, torch.nn.Module)
    assert "accuracy" in spec.metrics()
    assert isinstance(spec.optimizer(model.parameters()), torch.optim.Optimizer)


def test_missing_loss_is_named_with_module_path():
    with pytest.raises(ModelSpecError) as e:
        load_model_spec(FIXTURE_ZOO, "broken.no_loss.custom_model")
    msg = str(e.value)
    assert "'loss'" in msg and os.path.join("broken", "no_loss.py") in msg


def test_non_callable_is_reported():
    with pytest.raises(ModelSpecError, match="'feed_not_callable' is not callable"):
        load_model_spec(FIXTURE_ZOO, "broken.no_loss.custom_model", loss="custom_model",
                        feed="feed_not_callable")


def test_missing_factory_and_module():
    with pytest.raises(ModelSpecError, match="no model factory function 'nope'"):
        load_model_spec(FIXTURE_ZOO, "toy.linear.nope")
    with pytest.raises(ModelSpecError, match="not found"):
        load_model_spec(FIXTURE_ZOO, "toy.missing.custom_model")
    with pytest.raises(ModelSpecError, match="not a directory"):
        load_model_spec("/nonexistent/zoo", "toy.linear.custom_model")


def test_wrong_arity_is_reported():
    with pytest.raises(ModelSpecError, match="loss 'optimizer' must accept 2"):
        load_model_spec(FIXTURE_ZOO, "toy.linear.custom_model", loss="optimizer")


def test_factory_must_return_module():
    spec = load_model_spec(FIXTURE_ZOO, "toy.linear.custom_model", model_kwargs={"dim": 3})
    assert spec.build_model().fc.in_features == 3
    bad = load_model_spec(FIXTURE_ZOO, "toy.linear.reset")
    with pytest.raises(ModelSpecError, match="not a torch.nn.Module"):
        bad.build_model()
