"""A collapsed model: outputs that no longer depend on the inputs (issue 28).

A network whose ReLUs all died answers every input with the same output (its last
layer's bias): its loss sits at the labels' prior (ln 10 for ten balanced classes)
and looks, window by window, like a plateau. Async PS with stale gradients can do
that to a small CNN in its first steps (a digits CNN, 4 async workers, Adam at 1e-2:
6 of 12 seeds, every one at chance accuracy). The loss alone cannot tell such a
plateau from a converged CTR model's flat log loss; the outputs can: a healthy model
does not give *bit-identical* outputs for every record of a minibatch.

:class:`CollapseWatch` checks every training step's outputs (the first floating
tensor of at least two rows in them) for that, and a training task reports the
records of its collapsed steps (``collapsed_records``), the lowest model version one
of them trained on (``collapsed_at_version``) and the highest version a step that was
not collapsed trained on (``alive_at_version``: a model known to be alive there, where
a rollback may go back to); the master's training-health detector judges them
(:mod:`elasticdl.master.training_health`). The check is one comparison of the first
64 values of every record's output with the first record's; on CUDA the flags stay on
the device until the task ends (one synchronisation per task).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from elasticdl.worker.nested import leaves

SAMPLE = 64   # values of each record's output compared


def batch_output(outputs: Any) -> Optional[torch.Tensor]:
    """The tensor judged: the first floating one with at least two rows (None: none)."""
    for _, t in leaves(outputs):
        if t.is_floating_point() and t.dim() >= 1 and t.shape[0] >= 2:
            return t
    return None


class CollapseWatch:
    """One task's training steps whose outputs were identical for every record."""

    def __init__(self) -> None:
        self._steps: list[tuple[torch.Tensor, int, int]] = []   # this task's: bounded

    def observe(self, outputs: Any, records: int, version: int) -> None:
        """A training step's ``outputs`` over ``records`` records, at model ``version``."""
        t = batch_output(outputs)
        if t is None:
            return
        # the first SAMPLE values of each record's output: a collapsed model repeats all of
        # them, a live one differs in these already (a language model's logits: 64 of
        # B x T x V values, not all of them, each step)
        rows = t.detach().reshape(t.shape[0], -1)[:, :SAMPLE]
        self._steps.append(((rows[1:] == rows[:1]).all(), int(records), int(version)))

    def take(self) -> dict[str, int]:
        """The task's counters (empty: no step judged), and start afresh."""
        steps, self._steps = self._steps, []
        flags = [(bool(same), n, v) for same, n, v in steps]
        out = {}
        alive = [v for same, _, v in flags if not same]
        if alive:
            out["alive_at_version"] = max(0, max(alive))
        collapsed = [(n, v) for same, n, v in flags if same]
        if collapsed:
            out["collapsed_records"] = sum(n for n, _ in collapsed)
            out["collapsed_at_version"] = max(0, min(v for _, v in collapsed))
        return out
