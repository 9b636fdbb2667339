"""torch tensors <-> ``elasticdl.Tensor`` / ``TensorChunk`` messages.

A tensor travels as ``{name, dtype, shape, content}`` with ``content`` the
row-major little-endian bytes. Large tensors are cut into
:class:`TensorChunk` messages of :data:`DEFAULT_CHUNK_BYTES`; a
:class:`ChunkAssembler` writes arriving chunks straight into the memory of the
destination tensor (a preallocated one, e.g. a model parameter, or a fresh
one), so a chunked transfer costs one copy on each side beyond gRPC's own.

Every decoding function validates what it is given and raises ``ValueError``
with a message naming the tensor; servers turn that into INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Optional, Union

import numpy as np
import torch

from elasticdl.common.chunk_wire import ChunkView
from elasticdl.proto import elasticdl_pb2 as pb

DEFAULT_CHUNK_BYTES = 4 << 20
"""Chunk size of streamed tensors (measured best on loopback; see benchmarks/ps_bandwidth.py)."""

_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8,
    "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
# numpy has no bfloat16: its bytes are viewed as int16 on the way in and out
_NUMPY_VIEW = {torch.bfloat16: torch.int16}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little endian
    raise ImportError("elasticdl's tensor wire format assumes a little-endian host")

TensorLike = Union[torch.Tensor, np.ndarray]


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype (``torch.float32`` -> ``"float32"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel over the wire; supported: "
                         f"{', '.join(_DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype of a wire name; ``ValueError`` for an unknown one."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; supported: {', '.join(_DTYPES)}") from None


def _cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous()


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    flat = tensor.detach().reshape(-1)
    if flat.dtype in _NUMPY_VIEW:
        flat = flat.view(_NUMPY_VIEW[flat.dtype])
    return flat.numpy().view(np.uint8)


def to_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's raw bytes (one copy out of its memory)."""
    return byte_view(_cpu_contiguous(tensor)).tobytes()


def encode(tensor: TensorLike, name: str = "") -> pb.Tensor:
    """A ``Tensor`` message holding ``tensor`` (moved to CPU if needed)."""
    t = torch.from_numpy(np.ascontiguousarray(tensor)) if isinstance(tensor, np.ndarray) \
        else _cpu_contiguous(tensor)
    return pb.Tensor(name=name, dtype=dtype_name(t.dtype), shape=list(t.shape),
                     content=byte_view(t).tobytes())


def _numel(shape: Sequence[int], what: str) -> int:
    if any(d < 0 for d in shape):
        raise ValueError(f"{what}: negative dimension in shape {list(shape)}")
    return math.prod(shape)


def check_meta(what: str, dtype: str, shape: Sequence[int],
               expected_dtype: Optional[torch.dtype] = None,
               expected_shape: Optional[Sequence[int]] = None) -> torch.dtype:
    """Validate a tensor's wire dtype/shape against expectations; returns the torch dtype.

    Raises:
        ValueError: unknown dtype, negative dimension, or a mismatch (message names ``what``).
    """
    try:
        tdtype = torch_dtype(dtype)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    _numel(shape, what)
    if expected_dtype is not None and tdtype != expected_dtype:
        raise ValueError(f"{what}: dtype {dtype} does not match the expected "
                         f"{dtype_name(expected_dtype)}")
    if expected_shape is not None and list(shape) != list(expected_shape):
        raise ValueError(f"{what}: shape {list(shape)} does not match the expected "
                         f"{list(expected_shape)}")
    return tdtype


def decode(msg: pb.Tensor, expected_dtype: Optional[torch.dtype] = None,
           expected_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
    """A writable tensor owning a copy of the message's bytes.

    Raises:
        ValueError: unknown dtype, content size not matching dtype x shape, or
            a dtype/shape other than the expected ones.
    """
    what = f"tensor {msg.name!r}" if msg.name else "tensor"
    tdtype = check_meta(what, msg.dtype, msg.shape, expected_dtype, expected_shape)
    shape = list(msg.shape)
    nbytes = _numel(shape, what) * torch.empty((), dtype=tdtype).element_size()
    content = msg.content
    if len(content) != nbytes:
        raise ValueError(f"{what}: {len(content)} content bytes, but dtype {msg.dtype} and "
                         f"shape {shape} need {nbytes}")
    out = torch.empty(shape, dtype=tdtype)
    if nbytes:
        byte_view(out)[:] = np.frombuffer(content, dtype=np.uint8)
    return out


def decode_into(msg: pb.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """Copy a message's bytes into ``dest`` (a contiguous CPU tensor of the same
    dtype and shape), without an intermediate tensor; returns ``dest``.

    Raises:
        ValueError: dtype, shape or content size differ from ``dest``.
    """
    what = f"tensor {msg.name!r}" if msg.name else "tensor"
    check_meta(what, msg.dtype, msg.shape, dest.dtype, list(dest.shape))
    view = byte_view(dest)
    content = msg.content
    if len(content) != view.shape[0]:
        raise ValueError(f"{what}: {len(content)} content bytes, expected {view.shape[0]}")
    if len(content):
        view[:] = np.frombuffer(content, dtype=np.uint8)
    return dest


def decode_ids(msg: pb.Tensor, what: str = "ids") -> np.ndarray:
    """A 1-D int64 id array from a Tensor message (read-only view, no copy)."""
    check_meta(what, msg.dtype, msg.shape, torch.int64)
    if len(msg.shape) != 1:
        raise ValueError(f"{what}: ids must be 1-D, got shape {list(msg.shape)}")
    content = msg.content
    if len(content) != 8 * msg.shape[0]:
        raise ValueError(f"{what}: {len(content)} bytes for {msg.shape[0]} int64 ids")
    return np.frombuffer(content, dtype=np.int64)


def encode_ids(ids: TensorLike) -> pb.Tensor:
    """The ``Tensor`` form of a 1-D int64 id array."""
    arr = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    arr = np.ascontiguousarray(arr, dtype=np.int64).reshape(-1)
    return pb.Tensor(dtype="int64", shape=[arr.shape[0]], content=arr.tobytes())


# ------------------------------------------------------------------ chunks
def iter_chunks(name: str, tensor: torch.Tensor,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.TensorChunk]:
    """Cut a tensor into ``TensorChunk`` messages of at most ``chunk_bytes``.

    A tensor of zero bytes still yields one (empty) chunk so its name and
    shape arrive.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    t = _cpu_contiguous(tensor)
    view = byte_view(t)
    total = int(view.shape[0])
    dtype, shape = dtype_name(t.dtype), list(t.shape)
    offset = 0
    while True:
        end = min(offset + chunk_bytes, total)
        yield pb.TensorChunk(name=name, dtype=dtype, shape=shape, offset=offset,
                             total_bytes=total, content=view[offset:end].tobytes())
        offset = end
        if offset >= total:
            return


def whole_chunk_view(chunk: Union[pb.TensorChunk, ChunkView],
                     expected: Mapping[str, tuple[torch.dtype, Sequence[int]]]
                     ) -> Optional[torch.Tensor]:
    """A tensor *viewing* the chunk's content when the chunk holds the whole
    tensor (None otherwise), after checking name, dtype, shape and size.

    The view is read-only by contract: the content is an immutable ``bytes``
    the receiver owns alone, so this saves a copy of every tensor that fits in
    one chunk. Callers must not write into it.

    Raises:
        ValueError: unknown name or metadata not matching ``expected``.
    """
    if chunk.offset != 0 or len(chunk.content) != chunk.total_bytes:
        return None
    what = f"tensor {chunk.name!r}"
    if chunk.name not in expected:
        raise ValueError(f"{what}: unknown name")
    exp_dtype, exp_shape = expected[chunk.name]
    tdtype = check_meta(what, chunk.dtype, chunk.shape, exp_dtype, exp_shape)
    numel = math.prod(chunk.shape)
    if chunk.total_bytes != numel * torch.empty((), dtype=tdtype).element_size():
        raise ValueError(f"{what}: total_bytes {chunk.total_bytes} does not match dtype "
                         f"{chunk.dtype} and shape {list(chunk.shape)}")
    if numel == 0:
        return torch.empty(list(chunk.shape), dtype=tdtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        return torch.frombuffer(chunk.content, dtype=tdtype).view(list(chunk.shape))


class ChunkAssembler:
    """Reassembles tensors from ``TensorChunk`` messages.

    Chunks (messages, or :class:`~elasticdl.common.chunk_wire.ChunkView` s
    whose content is a view of the received bytes) of one tensor must arrive
    in order (offset equal to the bytes
    received so far); different tensors may follow each other. With
    ``destinations`` (name -> contiguous CPU tensor) chunks are written
    straight into those tensors, and only their names are accepted;
    ``expected`` (name -> (dtype, shape)) restricts names and metadata
    without giving memory.
    """

    def __init__(self, destinations: Optional[Mapping[str, torch.Tensor]] = None,
                 expected: Optional[Mapping[str, tuple[torch.dtype, Sequence[int]]]] = None):
        self._dest = destinations
        self._expected = expected
        self._out: dict[str, torch.Tensor] = {}
        self._received: dict[str, int] = {}
        self._total: dict[str, int] = {}
        self._views: dict[str, np.ndarray] = {}

    def add(self, chunk: Union[pb.TensorChunk, ChunkView]) -> Optional[str]:
        """Take one chunk; returns the tensor's name when it is now complete.

        Raises:
            ValueError: unknown name, metadata differing from earlier chunks or
                from the expectation, out-of-order or overflowing offsets.
        """
        name = chunk.name
        what = f"tensor {name!r}"
        if name not in self._views:
            self._start(chunk, what)
        elif (self._out[name].dtype != torch_dtype(chunk.dtype)
              or list(self._out[name].shape) != list(chunk.shape)
              or self._total[name] != chunk.total_bytes):
            raise ValueError(f"{what}: chunk metadata differs from its first chunk")
        received = self._received[name]
        if received >= self._total[name] and self._total[name] > 0:
            raise ValueError(f"{what}: more chunks after it was complete")
        if chunk.offset != received:
            raise ValueError(f"{what}: chunk at offset {chunk.offset}, expected {received}")
        content = chunk.content
        end = received + len(content)
        if end > self._total[name]:
            raise ValueError(f"{what}: chunk overflows total_bytes {self._total[name]}")
        if content:
            self._views[name][received:end] = np.frombuffer(content, dtype=np.uint8)
        self._received[name] = end
        return name if end == self._total[name] else None

    def _start(self, chunk: Union[pb.TensorChunk, ChunkView], what: str) -> None:
        name = chunk.name
        exp_dtype: Optional[torch.dtype] = None
        exp_shape: Optional[Sequence[int]] = None
        if self._dest is not None:
            if name not in self._dest:
                raise ValueError(f"{what}: unknown name")
            exp_dtype, exp_shape = self._dest[name].dtype, list(self._dest[name].shape)
        elif self._expected is not None:
            if name not in self._expected:
                raise ValueError(f"{what}: unknown name")
            exp_dtype, exp_shape = self._expected[name]
        tdtype = check_meta(what, chunk.dtype, chunk.shape, exp_dtype, exp_shape)
        out = self._dest[name] if self._dest is not None else torch.empty(list(chunk.shape),
                                                                           dtype=tdtype)
        nbytes = out.numel() * out.element_size()
        if chunk.total_bytes != nbytes:
            raise ValueError(f"{what}: total_bytes {chunk.total_bytes} but dtype "
                             f"{chunk.dtype} and shape {list(chunk.shape)} need {nbytes}")
        self._out[name] = out
        self._views[name] = byte_view(out)
        self._received[name] = 0
        self._total[name] = nbytes

    def complete(self, name: str) -> bool:
        return name in self._total and self._received[name] == self._total[name]

    def incomplete(self) -> list[str]:
        """Names with missing bytes."""
        return [n for n in self._total if self._received[n] != self._total[n]]

    def result(self) -> dict[str, torch.Tensor]:
        """Every assembled tensor.

        Raises:
            ValueError: a tensor is missing bytes.
        """
        missing = self.incomplete()
        if missing:
            raise ValueError(f"tensors incomplete at end of stream: {', '.join(missing)}")
        return dict(self._out)

    def pop(self, name: str) -> torch.Tensor:
        """Hand over a complete tensor and forget it (a name may then start again)."""
        if not self.complete(name):
            raise ValueError(f"tensor {name!r} is incomplete")
        self._views.pop(name)
        self._received.pop(name)
        self._total.pop(name)
        return self._out.pop(name)
