"""Warnings, at submission, for configurations that train but waste most of their work.

They do not stop a job (the configuration is legal); they are logged by the
CLI before anything starts, each naming the flags to change.
"""

from __future__ import annotations

from elasticdl.common.enums import JobType, Strategy
from elasticdl.common.job_spec import JobSpec


def config_warnings(spec: JobSpec) -> list[str]:
    """Plain-language warnings for ``spec``; empty when nothing looks wasteful."""
    out: list[str] = []
    if spec.job_type != JobType.TRAIN:
        return out
    workers = spec.num_workers
    if spec.distribution_strategy == Strategy.PS and not spec.use_async and workers > 1:
        # every applied group bumps the version; the pushes of the other workers that
        # computed on the previous version are then stale and rejected unless tolerated
        behind = -(-workers // spec.grads_to_wait) - 1
        if spec.sync_version_tolerance < behind:
            out.append(
                f"sync PS with --num_workers={workers}, --grads_to_wait={spec.grads_to_wait} "
                f"and --sync_version_tolerance={spec.sync_version_tolerance}: each applied "
                f"group makes the other workers' gradients {behind} version(s) stale, so "
                "most pushes are rejected and recomputed (a 2-worker, 2-PS job redid "
                f"119-130 of 144 steps). Use --grads_to_wait={workers}, "
                f"--sync_version_tolerance={behind} or --use_async.")
    return out


def effective_batch_note(spec: JobSpec) -> str:
    """A note when one optimizer step averages more records than ``--minibatch_size``
    (allreduce, sync PS with ``--grads_to_wait`` > 1); empty otherwise."""
    effective = effective_batch(spec)
    if spec.job_type != JobType.TRAIN or effective <= spec.minibatch_size:
        return ""
    return (f"each optimizer step averages up to {effective} records "
            f"({effective // spec.minibatch_size} x --minibatch_size={spec.minibatch_size}); "
            "a learning rate tuned for one process may need scaling "
            "(docs/training.md, 'Batch size and learning rate')")


def effective_batch(spec: JobSpec) -> int:
    """Records behind one optimizer step (at most)."""
    if spec.distribution_strategy == Strategy.ALLREDUCE:
        return spec.minibatch_size * spec.num_workers
    if spec.distribution_strategy == Strategy.PS and not spec.use_async:
        return spec.minibatch_size * spec.grads_to_wait
    return spec.minibatch_size
