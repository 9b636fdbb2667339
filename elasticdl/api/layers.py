"""User-facing layers.

:class:`Embedding` is a drop-in for ``torch.nn.Embedding`` whose table can
live on the parameter servers. In the Local and allreduce strategies it *is*
an ``nn.Embedding`` (a local ``weight`` parameter). Under
ParameterServerStrategy the trainer attaches it to the PS: the local weight is
dropped, each forward pulls only the deduplicated rows of the batch, and the
rows' gradient is pushed back to the PS that owns them.

Rows start as a pure function of ``(seed, id)`` (see
:mod:`elasticdl.ps.parameters`), so the local table and the lazily created PS
rows hold the same values, and a PS checkpoint exports to this layer's
``weight`` exactly.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from elasticdl.ps.parameters import TableSpec, initial_rows, parse_initializer

Lookup = Callable[["Embedding", torch.Tensor], torch.Tensor]

_TABLES_ON_PS = contextvars.ContextVar("elasticdl_tables_on_ps", default=False)


@contextlib.contextmanager
def tables_on_ps() -> Iterator[None]:
    """Models built inside skip the local tables of their :class:`Embedding` layers
    (the parameter-server trainer attaches them to the PS right after)."""
    token = _TABLES_ON_PS.set(True)
    try:
        yield
    finally:
        _TABLES_ON_PS.reset(token)


class Embedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim, padding_idx)`` with a PS-backed table.

    Args:
        initializer: ``"normal"`` (std 1, like ``nn.Embedding``), ``"normal:STD"``,
            ``"uniform:LOW:HIGH"``, ``"zeros"`` or ``"constant:V"``.
        seed: seed of the initializer; by default drawn from torch's generator,
            so ``torch.manual_seed`` makes it reproducible.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: Optional[int] = None, max_norm: Optional[float] = None,
                 scale_grad_by_freq: bool = False, sparse: bool = False, *,
                 initializer: str = "normal", seed: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None):
        super().__init__()
        if max_norm is not None or scale_grad_by_freq or sparse:
            raise ValueError("elasticdl Embedding does not support max_norm, "
                             "scale_grad_by_freq or sparse")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx {padding_idx} out of range")
            padding_idx = padding_idx % num_embeddings
        parse_initializer(initializer)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.initializer = initializer
        self.seed = int(torch.randint(0, 2**62, (), dtype=torch.int64)) if seed is None \
            else int(seed)
        self.table_dtype = dtype or torch.get_default_dtype()
        self._lookup: Optional[Lookup] = None
        self.table_name = ""
        self.weight: Optional[nn.Parameter]
        if _TABLES_ON_PS.get():
            self.register_parameter("weight", None)
            return
        rows = initial_rows(initializer, self.seed, np.arange(num_embeddings, dtype=np.int64),
                            embedding_dim, self.table_dtype,
                            -1 if padding_idx is None else padding_idx)
        self.weight = nn.Parameter(rows.to(device))

    def table_spec(self, name: str) -> TableSpec:
        """The PS table of this layer, named ``name`` (its weight's state-dict key)."""
        return TableSpec(name=name, num_embeddings=self.num_embeddings, dim=self.embedding_dim,
                         initializer=self.initializer, seed=self.seed,
                         padding_idx=-1 if self.padding_idx is None else self.padding_idx,
                         dtype=self.table_dtype)

    @property
    def on_ps(self) -> bool:
        return self._lookup is not None

    def attach(self, lookup: Lookup, table_name: str) -> None:
        """Move the table to the PS: drop the local weight, look rows up via ``lookup``."""
        self._lookup = lookup
        self.table_name = table_name
        if self.weight is not None:
            del self.weight
            self.register_parameter("weight", None)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._lookup is not None:
            return self._lookup(self, input)
        if self.weight is None:
            raise RuntimeError("Embedding built inside tables_on_ps() was never attached to "
                               "a parameter server")
        return F.embedding(input, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        where = f", table on PS as {self.table_name!r}" if self.on_ps else ""
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return (f"{self.num_embeddings}, {self.embedding_dim}{pad}, "
                f"initializer={self.initializer!r}{where}")
