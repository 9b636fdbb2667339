"""User-facing layers.

:class:`Embedding` is a drop-in for ``torch.nn.Embedding`` whose table can live
on the parameter servers; :class:`EmbeddingBag` the same for ``torch.nn.EmbeddingBag``.
Models written with torch's own classes need neither: under ParameterServerStrategy
their big tables are swapped for these (:mod:`elasticdl.api.torch_tables`).

Same signature, same initialisation (``N(0, 1)``, padding row zero,
``reset_parameters()``), a real ``weight`` parameter at construction in every
strategy, so the usual init idioms work unchanged::

    self.embedding = Embedding(sum(field_dims), embed_dim)
    torch.nn.init.xavier_uniform_(self.embedding.weight.data)     # torchfm
    torch.nn.init.normal_(self.embedding.weight, mean=0, std=1e-4)  # DeepCTR-Torch

and ``torch.manual_seed(s)`` + the same model code gives the same rows in
Local, allreduce and on the PS. Under ParameterServerStrategy the worker that
initialises the PS sends each table's rows *as the model code left them* (in
chunks); then the trainer attaches the layer to the PS: the local weight is
dropped, each forward pulls only the deduplicated rows of the batch, and the
rows' gradient is pushed back to the PS that owns them.

**Lazy tables.** A table too big to materialise is created row by row on the
PS from a seeded initializer (a pure function of ``(seed, id)``, see
:mod:`elasticdl.ps.parameters`). A table is lazy when ``initializer=`` is given
(``"normal"``, ``"normal:STD"``, ``"uniform:LOW:HIGH"``, ``"zeros"``,
``"constant:V"``) or when ``num_embeddings * embedding_dim * itemsize`` exceeds
:attr:`Embedding.MATERIALIZE_MAX_BYTES` (1 GiB; set the class attribute at the
top of the model module to change it: every process imports the module). Under
ParameterServerStrategy a lazy table has no local weight: touching ``.weight``
raises :class:`LazyTableError` saying why. Elsewhere its weight holds exactly
the rows the PS would create.

**Options.** ``sparse=True``: Local keeps torch's semantics (a sparse gradient:
use an optimizer that takes one, e.g. ``SparseAdam``/``SGD``/``Adagrad``); on
the PS rows are updated row-wise anyway, so it changes nothing there; allreduce
synchronises the touched rows (docs/allreduce.md). ``scale_grad_by_freq=True`` is
exact everywhere (the PS lookup scales by the count of each id in the minibatch, as
torch does).
``max_norm`` is refused (it rewrites rows in place at lookup, which the PS does
not do). ``_weight``/``_freeze`` (``from_pretrained``) are supported; a frozen
table is refused under ParameterServerStrategy.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from elasticdl.common.tables import TableSpec, initial_rows, parse_initializer


@dataclass(frozen=True)
class PulledRows:
    """What a table's lookup returns for one forward: the deduplicated rows of the
    ids (``rows``, a leaf whose gradient goes to the rows' owner), ``index``: the ids
    remapped to positions in ``rows`` (same shape), and ``padding``: the position of
    the layer's ``padding_idx`` among the rows (None when it is not among them)."""

    rows: torch.Tensor
    index: torch.Tensor
    padding: Optional[int] = None


Lookup = Callable[["Embedding", torch.Tensor], PulledRows]

_TABLES_ON_PS = contextvars.ContextVar("elasticdl_tables_on_ps", default=False)


@contextlib.contextmanager
def tables_on_ps() -> Iterator[None]:
    """Models built inside are meant for ParameterServerStrategy: lazy tables get
    no local weight (the parameter-server trainer attaches every table right after)."""
    token = _TABLES_ON_PS.set(True)
    try:
        yield
    finally:
        _TABLES_ON_PS.reset(token)


class LazyTableError(AttributeError):
    """``.weight`` of a table that has none here (lazy on the PS, or attached to the PS)."""


class Embedding(nn.Module):
    """``torch.nn.Embedding`` whose table can live on the parameter servers.

    Args (beyond ``nn.Embedding``'s, keyword only):
        initializer: makes the table lazy (see the module doc): ``"normal"`` (std 1),
            ``"normal:STD"``, ``"uniform:LOW:HIGH"``, ``"zeros"`` or ``"constant:V"``.
        seed: seed of a lazy table's initializer; by default drawn from torch's
            generator, so ``torch.manual_seed`` makes it reproducible.
        admit_after, ttl_versions, ttl_seconds, max_rows: admission and eviction of the
            table's rows on the parameter servers (docs/parameter_server.md; None: the
            job's ``--embedding_admit_after``, ``--embedding_ttl_versions``,
            ``--embedding_ttl_seconds``, ``--embedding_max_rows``): a row only on an id's
            Nth training pull; evict rows not updated for this many model versions, or
            seconds (either TTL evicts); at most this many rows, all PS together (least
            recently updated evicted). Other strategies ignore them.

    Raises:
        ValueError: ``max_norm``, bad sizes, ``padding_idx`` or initializer.
    """

    MATERIALIZE_MAX_BYTES = 1 << 30

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: Optional[int] = None, max_norm: Optional[float] = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False,
                 _weight: Optional[torch.Tensor] = None, _freeze: bool = False,
                 device: Any = None, dtype: Optional[torch.dtype] = None, *,
                 initializer: Optional[str] = None, seed: Optional[int] = None,
                 admit_after: Optional[int] = None, ttl_versions: Optional[int] = None,
                 max_rows: Optional[int] = None, ttl_seconds: Optional[float] = None):
        super().__init__()
        for what, value, low in (("admit_after", admit_after, 1),
                                 ("ttl_versions", ttl_versions, 0), ("max_rows", max_rows, 0),
                                 ("ttl_seconds", ttl_seconds, 0)):
            if value is not None and not value >= low:
                raise ValueError(f"Embedding {what} must be >= {low}, got {value}")
        self.admit_after, self.ttl_versions, self.max_rows = admit_after, ttl_versions, max_rows
        self.ttl_seconds = ttl_seconds
        if max_norm is not None:
            raise ValueError("elasticdl Embedding does not support max_norm: it renormalises "
                             "rows in place at lookup, which the parameter servers do not do; "
                             "renormalise the looked-up vectors in forward() instead")
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(f"Embedding needs num_embeddings and embedding_dim > 0, got "
                             f"{num_embeddings} x {embedding_dim}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx {padding_idx} out of range for "
                                 f"{num_embeddings} embeddings")
            padding_idx = padding_idx % num_embeddings
        if initializer is not None:
            parse_initializer(initializer)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.max_norm = None
        self.norm_type = norm_type
        self.scale_grad_by_freq = bool(scale_grad_by_freq)
        self.sparse = bool(sparse)
        self.table_dtype = dtype or (_weight.dtype if _weight is not None
                                     else torch.get_default_dtype())
        nbytes = num_embeddings * embedding_dim * torch.empty((), dtype=self.table_dtype
                                                              ).element_size()
        self.lazy_reason = ""
        if initializer is not None:
            self.lazy_reason = f"it was given initializer={initializer!r}"
        elif _weight is None and nbytes > self.MATERIALIZE_MAX_BYTES:
            initializer = "normal"
            self.lazy_reason = (f"its {nbytes / 2**30:.1f} GiB exceed "
                                f"Embedding.MATERIALIZE_MAX_BYTES "
                                f"({self.MATERIALIZE_MAX_BYTES / 2**30:.1f} GiB)")
        self.initializer = initializer  # None: materialised like nn.Embedding
        self.seed: Optional[int] = None
        if self.lazy:
            self.seed = int(torch.randint(0, 2**62, (), dtype=torch.int64)) if seed is None \
                else int(seed)
        self._lookup: Optional[Lookup] = None
        self.table_name = ""
        if _weight is not None:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError(f"_weight has shape {tuple(_weight.shape)}, expected "
                                 f"{(num_embeddings, embedding_dim)}")
            self.weight = nn.Parameter(_weight, requires_grad=not _freeze)
        elif self.lazy and _TABLES_ON_PS.get():
            self.register_parameter("weight", None)
        elif self.lazy:
            assert initializer is not None and self.seed is not None
            rows = initial_rows(initializer, self.seed,
                                np.arange(num_embeddings, dtype=np.int64), embedding_dim,
                                self.table_dtype, -1 if padding_idx is None else padding_idx)
            self.weight = nn.Parameter(rows.to(device), requires_grad=not _freeze)
        else:
            self.weight = nn.Parameter(torch.empty((num_embeddings, embedding_dim),
                                                   device=device, dtype=self.table_dtype),
                                       requires_grad=not _freeze)
            self.reset_parameters()

    @property
    def lazy(self) -> bool:
        """Rows come from the seeded initializer, created on the PS when first used."""
        return self.initializer is not None

    def reset_parameters(self) -> None:
        """``N(0, 1)``, padding row zero (``nn.Embedding.reset_parameters``)."""
        weight = self._parameters.get("weight")
        if weight is None:
            raise self._no_weight()
        nn.init.normal_(weight)
        self._fill_padding_idx_with_zero()

    def _fill_padding_idx_with_zero(self) -> None:
        weight = self._parameters.get("weight")
        if self.padding_idx is not None and weight is not None:
            with torch.no_grad():
                weight[self.padding_idx].fill_(0)

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True,
                        padding_idx: Optional[int] = None, max_norm: Optional[float] = None,
                        norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                        sparse: bool = False) -> Embedding:
        """``nn.Embedding.from_pretrained``."""
        if embeddings.dim() != 2:
            raise ValueError("Embeddings parameter is expected to be 2-dimensional")
        rows, cols = embeddings.shape
        return cls(rows, cols, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse,
                   _weight=embeddings, _freeze=freeze)

    # ------------------------------------------------------------ the weight
    def __getattr__(self, name: str) -> Any:
        params = self.__dict__.get("_parameters")
        if name == "weight" and params is not None and params.get("weight") is None:
            raise self._no_weight()
        return super().__getattr__(name)

    def _no_weight(self) -> LazyTableError:
        if self._lookup is not None:
            return LazyTableError(
                f"Embedding {self.table_name!r} lives on the parameter servers: there is no "
                "local weight (each forward pulls the rows of its ids). Initialise tables in "
                "the model's constructor; read the trained table from the exported model.")
        return LazyTableError(
            f"Embedding({self.num_embeddings}, {self.embedding_dim}) is a lazy table because "
            f"{self.lazy_reason}: under ParameterServerStrategy its rows are created on the "
            f"parameter servers from the seeded initializer {self.initializer!r}, so there is "
            "no local weight to initialise or read. Drop initializer= (and keep the table "
            "under Embedding.MATERIALIZE_MAX_BYTES) to get a materialised weight that "
            "nn.init functions can set.")

    def initial_weight(self) -> Optional[torch.Tensor]:
        """The local weight's values (None for a lazy table or one attached to the PS)."""
        weight = self._parameters.get("weight")
        return None if weight is None or self.lazy else weight.detach()

    def table_spec(self, name: str) -> TableSpec:
        """The PS table of this layer, named ``name`` (its weight's state-dict key);
        a materialised table says its rows are given explicitly (``explicit``)."""
        return TableSpec(name=name, num_embeddings=self.num_embeddings, dim=self.embedding_dim,
                         initializer=self.initializer or "normal", seed=self.seed or 0,
                         padding_idx=-1 if self.padding_idx is None else self.padding_idx,
                         dtype=self.table_dtype, explicit=not self.lazy,
                         admit_after=self.admit_after, ttl_versions=self.ttl_versions,
                         max_rows=self.max_rows, ttl_seconds=self.ttl_seconds)

    @property
    def on_ps(self) -> bool:
        return self._lookup is not None

    def attach(self, lookup: Lookup, table_name: str) -> None:
        """Move the table to the PS: drop the local weight, look rows up via ``lookup``."""
        weight = self._parameters.get("weight")
        if weight is not None and not weight.requires_grad:
            raise ValueError(f"Embedding {table_name!r} is frozen (requires_grad=False): "
                             "frozen tables are not supported under ParameterServerStrategy")
        self._lookup = lookup
        self.table_name = table_name
        if weight is not None:
            del self._parameters["weight"]
            self.register_parameter("weight", None)

    def local_weight(self) -> torch.Tensor:
        """The weight of a table that is not attached (raises if there is none)."""
        weight = self._parameters.get("weight")
        if weight is None:
            raise RuntimeError(f"{type(self).__name__} built inside tables_on_ps() was never "
                               "attached to a parameter server")
        return weight

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._lookup is not None:
            pulled = self._lookup(self, input)
            return F.embedding(pulled.index, pulled.rows, pulled.padding, None, self.norm_type,
                               self.scale_grad_by_freq, False)
        return F.embedding(input, self.local_weight(), self.padding_idx, None, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        if self.sparse:
            s += ", sparse=True"
        if self.lazy:
            s += f", initializer={self.initializer!r}"
        if self.on_ps:
            s += f", table on PS as {self.table_name!r}"
        return s


class EmbeddingBag(Embedding):
    """``torch.nn.EmbeddingBag`` whose table can live on the parameter servers
    (what :func:`elasticdl.api.torch_tables.tables_to_ps` turns a torch
    ``nn.EmbeddingBag`` into). Same signature, same initialisation and forward
    (``input``, ``offsets``, ``per_sample_weights``; modes ``sum``/``mean``/``max``,
    ``padding_idx``, ``include_last_offset``). Attached to the PS, the bag is
    reduced by ``F.embedding_bag`` over the batch's pulled unique rows (ids
    remapped to their positions), so autograd gives exactly the rows' gradient.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 max_norm: Optional[float] = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, mode: str = "mean", sparse: bool = False,
                 _weight: Optional[torch.Tensor] = None, include_last_offset: bool = False,
                 padding_idx: Optional[int] = None, device: Any = None,
                 dtype: Optional[torch.dtype] = None, *, _freeze: bool = False,
                 initializer: Optional[str] = None, seed: Optional[int] = None):
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"EmbeddingBag mode must be sum, mean or max, got {mode!r}")
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
                         scale_grad_by_freq, sparse, _weight, _freeze, device, dtype,
                         initializer=initializer, seed=seed)

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True,  # type: ignore[override]
                        max_norm: Optional[float] = None, norm_type: float = 2.0,
                        scale_grad_by_freq: bool = False, mode: str = "mean",
                        sparse: bool = False, include_last_offset: bool = False,
                        padding_idx: Optional[int] = None) -> EmbeddingBag:
        """``nn.EmbeddingBag.from_pretrained``."""
        if embeddings.dim() != 2:
            raise ValueError("Embeddings parameter is expected to be 2-dimensional")
        rows, cols = embeddings.shape
        return cls(rows, cols, max_norm, norm_type, scale_grad_by_freq, mode, sparse,
                   embeddings, include_last_offset, padding_idx, _freeze=freeze)

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,  # type: ignore[override]
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self._lookup is not None:
            pulled = self._lookup(self, input)
            index = pulled.index if offsets is None else pulled.index.to(offsets.dtype)
            return F.embedding_bag(index, pulled.rows, offsets, None, self.norm_type,
                                   self.scale_grad_by_freq, self.mode, False,
                                   per_sample_weights, self.include_last_offset,
                                   pulled.padding)
        return F.embedding_bag(input, self.local_weight(), offsets, None, self.norm_type,
                               self.scale_grad_by_freq, self.mode, self.sparse,
                               per_sample_weights, self.include_last_offset, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}" + \
            (", include_last_offset=True" if self.include_last_offset else "")
