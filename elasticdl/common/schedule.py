"""The one "every N model versions" rule of a job: when to evaluate, when to checkpoint.

Every component that acts on model versions (the master's job core, the PS,
the allreduce members, the Local runtime) asks the same :class:`Schedule`,
built once from the JobSpec, instead of writing its own ``version % N`` test.

A step is *due* when the version crossed a multiple of N since the last time
the action ran (``last``): ``version // N > last // N``. That holds whether
versions are seen one by one (a PS applying updates), in jumps (a worker that
reports rarely, a PS rollback) or resumed from a checkpoint, and one report of
a huge version cannot switch the rule off: the caller validates versions and
``last`` only moves forward with the versions it accepted.

Epoch-end and final evaluations are not part of this rule: the job core runs
them always, once per epoch and once at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Schedule:
    """``evaluation_steps`` / ``checkpoint_steps``: 0 switches the periodic action off."""

    evaluation_steps: int = 0
    checkpoint_steps: int = 0

    def __post_init__(self) -> None:
        for name in ("evaluation_steps", "checkpoint_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_spec(cls, spec: Any) -> Schedule:
        """From a JobSpec; checkpoints are due only when ``--checkpoint_dir`` is set."""
        return cls(evaluation_steps=spec.evaluation_steps,
                   checkpoint_steps=spec.checkpoint_steps if spec.checkpoint_dir else 0)

    @staticmethod
    def crossed(every: int, version: int, last: int) -> bool:
        """Whether ``version`` passed a multiple of ``every`` after ``last``."""
        return every > 0 and version > last and version // every > last // every

    def eval_due(self, version: int, last_evaluated: int) -> bool:
        """A periodic evaluation is due at ``version`` (last one at ``last_evaluated``)."""
        return self.crossed(self.evaluation_steps, version, last_evaluated)

    def checkpoint_due(self, version: int, last_saved: int) -> bool:
        """A checkpoint is due at ``version`` (last one at ``last_saved``)."""
        return self.crossed(self.checkpoint_steps, version, last_saved)
