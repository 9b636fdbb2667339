"""Loading a trained model from any checkpoint layout for evaluation/prediction."""

from __future__ import annotations

import os
from typing import Any

from elasticdl.common import checkpoint as ckpt


def load_for_inference(trainer: Any, path: str) -> int:
    """Load model weights (and version) from a single-writer or PS checkpoint.

    Returns the model version. Raises CheckpointError when nothing usable is there.
    """
    vdir = ckpt.resolve(path)
    if os.path.exists(os.path.join(vdir, "model.pt")):
        state = ckpt.load_single(vdir, map_location=str(trainer.device))
        trainer.model.load_state_dict(state["model"])
        trainer.model_version = int(state.get("model_version", ckpt.version_of(vdir)))
    else:
        from elasticdl.ps.checkpoint import export_state_dict

        trainer.model.load_state_dict(export_state_dict(vdir))
        trainer.model_version = ckpt.version_of(vdir)
    return trainer.model_version
