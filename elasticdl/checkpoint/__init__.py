"""Checkpoints: ``torch.save`` state dicts under ``<dir>/version-<N>/``.

:mod:`elasticdl.checkpoint.api` is the surface every other package uses;
``paths`` is the torch-free layout (the master uses it), ``single`` the
single-writer files (Local, allreduce), ``ps_shards`` the per-PS files.
"""
