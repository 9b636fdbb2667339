"""torch's own ``nn.Embedding`` and ``nn.EmbeddingBag`` as parameter-server tables.

Models are published with torch's classes (facebookresearch/dlrm, torchfm,
DeepCTR-Torch). Under ParameterServerStrategy :func:`tables_to_ps` swaps, in
place and after the model code ran, every such module whose table is big enough
(``sparse=True``, or at least ``min_elements`` elements) for the equivalent
:class:`~elasticdl.api.layers.Embedding` / :class:`~elasticdl.api.layers.EmbeddingBag`
holding the same weight: same attribute name, same state-dict key
(``<module>.weight``), same options, and the initial values the model code
produced. The parameter-server trainer then attaches each of them like any
``layers.Embedding``: every forward pulls the batch's deduplicated rows, and the
rows' gradient is pushed to the PS that owns them.

What a PS table cannot honour is refused by :func:`tables_to_ps` with
:class:`TableSwapError`, naming the module: ``max_norm`` (torch rewrites rows in
place at lookup), a frozen table (``requires_grad=False``), a table whose weight
another module shares (tied weights), and with ``min_elements < 0`` (no swap) a
``sparse=True`` table (its sparse gradient has no place in a dense push).
"""

from __future__ import annotations

import logging
from typing import Union

from torch import nn

from elasticdl.api.layers import Embedding, EmbeddingBag

logger = logging.getLogger(__name__)

TorchTable = Union[nn.Embedding, nn.EmbeddingBag]


class TableSwapError(ValueError):
    """A torch embedding the parameter servers cannot hold as it is; names the module."""


def _is_torch_table(module: nn.Module) -> bool:
    return type(module) in (nn.Embedding, nn.EmbeddingBag)


def qualifies(module: TorchTable, min_elements: int) -> bool:
    """Whether ``module`` becomes a PS table: ``sparse=True`` or at least
    ``min_elements`` elements (``min_elements < 0``: never)."""
    if min_elements < 0:
        return False
    return bool(module.sparse) or module.weight.numel() >= min_elements


def convert(module: TorchTable, where: str = "", check: bool = True) -> Embedding:
    """The ``layers`` equivalent of one torch table, holding its weight's values
    (``check=False``, for inference: whatever its ``max_norm`` or ``requires_grad``).

    Raises:
        TableSwapError: ``max_norm`` or a frozen weight (when ``check``).
    """
    what = where or type(module).__name__
    if check and module.max_norm is not None:
        raise TableSwapError(f"{what}: max_norm={module.max_norm} renormalises rows in place "
                             "at lookup, which a parameter-server table does not do; "
                             "renormalise the looked-up vectors in forward() instead, or keep "
                             "the table dense (a larger --ps_table_min_elements, sparse=False)")
    if check and not module.weight.requires_grad:
        raise TableSwapError(f"{what}: a frozen table (requires_grad=False) is not supported "
                             "on the parameter servers; keep it dense (a larger "
                             "--ps_table_min_elements, sparse=False)")
    weight = module.weight.detach()
    if isinstance(module, nn.EmbeddingBag):
        out: Embedding = EmbeddingBag(
            module.num_embeddings, module.embedding_dim, None, module.norm_type,
            module.scale_grad_by_freq, module.mode, module.sparse, weight,
            module.include_last_offset, module.padding_idx)
    else:
        out = Embedding(module.num_embeddings, module.embedding_dim, module.padding_idx, None,
                        module.norm_type, module.scale_grad_by_freq, module.sparse, weight)
    out.train(module.training)
    return out


def tables_to_ps(model: nn.Module, min_elements: int) -> list[str]:
    """Swap every qualifying torch table of ``model`` in place (see the module doc);
    returns the swapped modules' names.

    Raises:
        TableSwapError: a table that cannot be a PS table (see the module doc).
    """
    shared: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    swaps = []
    for name, module in model.named_modules():
        if not _is_torch_table(module):
            continue
        what = f"{type(module).__name__} {name or '(model)'!r}"
        if not qualifies(module, min_elements):
            if module.sparse:
                raise TableSwapError(f"{what}: sparse=True gives a sparse gradient, which a "
                                     "dense parameter-server push does not carry; let it be a "
                                     "PS table (--ps_table_min_elements >= 0) or use "
                                     "sparse=False")
            continue
        users = shared.get(id(module.weight), [])
        if len(users) > 1:
            raise TableSwapError(f"{what}: its weight is shared with {sorted(users)} (tied "
                                 "weights); a PS table is only reachable through lookups")
        swaps.append((name, convert(module, what)))
    if not swaps:
        return []
    if swaps[0][0] == "":
        raise TableSwapError("the model itself is an embedding table; wrap it in a module")
    for name, new in swaps:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        parent._modules[attr] = new   # keeps the attribute name, hence the state-dict key
    logger.info("torch embedding tables on the parameter servers: %s",
                ", ".join(f"{n} ({m.num_embeddings} x {m.embedding_dim})" for n, m in swaps))
    return [n for n, _ in swaps]


__all__ = ["TableSwapError", "convert", "qualifies", "tables_to_ps"]
