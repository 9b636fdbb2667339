"""Checkpoints: ``torch.save`` state dicts under ``<dir>/version-<N>/``.

:mod:`elasticdl.checkpoint.api` is the surface every other package uses;
``paths`` is the torch-free layout (the master uses it), ``single`` the
single-writer files (Local, allreduce), ``ps_shards`` the per-PS file format and export
(a PS saves and restores its shard with :mod:`elasticdl.ps.shard_checkpoint`), ``restore``
the rule of what a PS restores from, and
``data_position`` (torch-free) what records a checkpoint's model was trained
on and the task-manager state a job resumes from.
"""
