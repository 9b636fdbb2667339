"""checkpoint.api.export_model: model.pt always; TorchScript only when asked, and
any failure in it (whatever it raises) is a warning, never an error."""

import logging
import os

import pytest
import torch

from elasticdl.checkpoint.api import export_model


class Scriptable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x)


class NotScriptable(Scriptable):
    def forward(self, x, *rest):  # varargs: TorchScript's frontend refuses them
        return self.fc(x)


def test_state_dict_only_by_default(tmp_path):
    model = Scriptable()
    paths = export_model(model, str(tmp_path))
    assert paths == [str(tmp_path / "model.pt")]
    assert not os.path.exists(tmp_path / "model_scripted.pt")
    fresh = Scriptable()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    x = torch.randn(4, 3)
    assert torch.equal(fresh(x), model(x))


def test_torchscript_when_asked(tmp_path):
    model = Scriptable()
    paths = export_model(model, str(tmp_path), torchscript=True)
    assert paths[1] == str(tmp_path / "model_scripted.pt")
    x = torch.randn(4, 3)
    assert torch.equal(torch.jit.load(paths[1])(x), model(x))


def test_a_model_that_does_not_script_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="elasticdl.checkpoint.api"):
        paths = export_model(NotScriptable(), str(tmp_path), torchscript=True)
    assert paths == [str(tmp_path / "model.pt")]
    assert sorted(os.listdir(tmp_path)) == ["model.pt"]  # no partial scripted file
    [record] = caplog.records
    assert "NotScriptable does not compile to TorchScript" in record.getMessage()


@pytest.mark.parametrize("error", [OSError("Failed to get source"), TypeError("odd type"),
                                   AttributeError("no attribute"), ValueError("bad")])
def test_any_scripting_error_is_a_warning_naming_it(tmp_path, caplog, monkeypatch, error):
    def fail(model):
        raise error

    monkeypatch.setattr(torch.jit, "script", fail)
    with caplog.at_level(logging.WARNING, logger="elasticdl.checkpoint.api"):
        paths = export_model(Scriptable(), str(tmp_path), torchscript=True)
    assert paths == [str(tmp_path / "model.pt")]
    assert f"{type(error).__name__}: {error}" in caplog.records[0].getMessage()


def test_hugging_face_gpt2_exports_its_state_dict(tmp_path, caplog):
    """The issue's case: GPT2LMHeadModel raises OSError in torch.jit.script."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)
    model = transformers.GPT2LMHeadModel(config)
    with caplog.at_level(logging.WARNING, logger="elasticdl.checkpoint.api"):
        paths = export_model(model, str(tmp_path), torchscript=True)
    assert paths == [str(tmp_path / "model.pt")]
    assert "GPT2LMHeadModel does not compile to TorchScript (OSError" in caplog.text
    fresh = transformers.GPT2LMHeadModel(config)  # the upstream class, unchanged keys
    fresh.load_state_dict(torch.load(paths[0], weights_only=True))
    ids = torch.randint(0, 100, (2, 8))
    model.eval()
    fresh.eval()
    assert torch.equal(fresh(ids).logits, model(ids).logits)


def test_model_pt_write_failure_is_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError):
        export_model(Scriptable(), str(blocker / "out"))
