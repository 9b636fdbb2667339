"""Copy-saving (de)serialisation of the two bulk PS messages.

``GradientChunk`` (worker -> PS) and ``DenseChunk`` (PS -> worker) carry a
``TensorChunk`` whose ``content`` is most of the bytes. Going through the
generated protobuf classes costs four copies of the content on each side
(``tobytes``, setting the field, ``SerializeToString``; parsing, reading the
field, copying it out); see benchmarks/ps_bandwidth.py. This module writes the
*same protobuf wire bytes* directly from the tensor's memory (one copy) and
reads them back as a ``memoryview`` into the received buffer (no copy), so a
generated-stub client or server interoperates unchanged (tested).

Only these fields are produced/consumed here; any other message goes through
the generated classes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
from google.protobuf.message import DecodeError

from elasticdl.proto import elasticdl_pb2 as pb

Buffer = Union[bytes, memoryview]

# Chunk sizes a puller may ask for. Each chunk costs a message and a cached
# header on the PS, so tiny chunks multiply the PS's memory and lock time (1-byte
# chunks of a 1 MiB tensor took ~600 MiB and held the shard lock for seconds);
# huge ones defeat streaming. The PS answers INVALID_ARGUMENT outside the range.
MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 64 << 20


def check_chunk_bytes(chunk_bytes: int) -> int:
    """``chunk_bytes`` if within [MIN_CHUNK_BYTES, MAX_CHUNK_BYTES]; raises ValueError."""
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}] "
                         f"(0: the PS default), got {chunk_bytes}")
    return chunk_bytes


def clamp_chunk_bytes(chunk_bytes: int) -> int:
    """The nearest chunk size a PS accepts (clients asking for pulls)."""
    return min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, chunk_bytes))


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 negatives travel as 10-byte two's complement
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("malformed message: truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview):
    """Yield ``(field_number, wire_type, value)``: an int for varints, else a memoryview."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
            yield number, wire, value
        elif wire == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > end:
                raise ValueError("malformed message: field runs past the end")
            yield number, wire, buf[pos:pos + length]
            pos += length
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > end:
                raise ValueError("malformed message: field runs past the end")
            yield number, wire, buf[pos:pos + size]
            pos += size
        else:
            raise ValueError(f"malformed message: wire type {wire}")


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass
class ChunkView:
    """A parsed ``TensorChunk`` whose content is a view into the received bytes."""

    name: str = ""
    dtype: str = ""
    shape: tuple[int, ...] = ()
    offset: int = 0
    total_bytes: int = 0
    content: Buffer = b""


def _parse_tensor_chunk(buf: memoryview) -> ChunkView:
    c = ChunkView()
    shape: list[int] = []
    for number, wire, value in _fields(buf):
        if number == 1 and wire == 2:
            c.name = bytes(value).decode("utf-8")
        elif number == 2 and wire == 2:
            c.dtype = bytes(value).decode("utf-8")
        elif number == 3 and wire == 2:  # packed
            pos = 0
            while pos < len(value):
                dim, pos = _read_varint(value, pos)
                shape.append(_signed(dim))
        elif number == 3 and wire == 0:
            shape.append(_signed(value))
        elif number == 4 and wire == 0:
            c.offset = _signed(value)
        elif number == 5 and wire == 0:
            c.total_bytes = _signed(value)
        elif number == 6 and wire == 2:
            c.content = value
    c.shape = tuple(shape)
    return c


def _tensor_chunk_wire(name: str, dtype: str, shape: tuple[int, ...], offset: int,
                       total_bytes: int, content: Buffer) -> list[Buffer]:
    head = pb.TensorChunk(name=name, dtype=dtype, shape=shape, offset=offset,
                          total_bytes=total_bytes).SerializeToString()
    n = len(content)
    return [head, b"\x32", _varint(n), content] if n else [head]


def _wrap(field_tag: bytes, inner: list[Buffer]) -> list[Buffer]:
    return [field_tag, _varint(sum(len(p) for p in inner)), *inner]


def tensor_chunks_wire(name: str, view: np.ndarray, dtype: str, shape: tuple[int, ...],
                       chunk_bytes: int) -> list[tuple[int, list[Buffer]]]:
    """``(offset, parts)`` of each chunk of a tensor's uint8 ``view`` (parts not joined)."""
    total = int(view.shape[0])
    out = []
    offset = 0
    mv = memoryview(view)  # type: ignore[arg-type]
    while True:
        end = min(offset + chunk_bytes, total)
        out.append((offset, _tensor_chunk_wire(name, dtype, shape, offset, total,
                                               mv[offset:end])))
        offset = end
        if offset >= total:
            return out


def dense_chunk_bytes(initialized: bool, version: int, is_buffer: bool,
                      chunk_parts: Optional[list[Buffer]]) -> bytes:
    """A serialised ``DenseChunk`` (one copy of the content)."""
    head = pb.DenseChunk(initialized=initialized, version=version,
                         is_buffer=is_buffer).SerializeToString()
    if chunk_parts is None:
        return head
    return b"".join([head, *_wrap(b"\x1a", chunk_parts)])


def gradient_chunk_bytes(chunk_parts: list[Buffer], version: int = 0, worker_id: int = 0,
                         learning_rate: float = 0.0, task_id: int = 0, minibatch: int = 0,
                         num_records: int = 0, epoch: int = 0, lr_reductions: int = 0,
                         lr_scale: float = 0.0, sync_group: int = 0) -> bytes:
    """A serialised ``GradientChunk`` holding a dense ``TensorChunk`` (one copy)."""
    head = pb.GradientChunk(version=version, worker_id=worker_id, learning_rate=learning_rate,
                            task_id=task_id, minibatch=minibatch, num_records=num_records,
                            epoch=epoch, lr_reductions=lr_reductions,
                            lr_scale=lr_scale if lr_scale != 1.0 else 0.0,
                            sync_group=sync_group).SerializeToString()
    return b"".join([head, *_wrap(b"\x22", chunk_parts)])


@dataclass
class DenseChunkView:
    initialized: bool = False
    version: int = 0
    is_buffer: bool = False
    chunk: Optional[ChunkView] = None


def parse_dense_chunk(data: bytes) -> DenseChunkView:
    """Parse a serialised ``DenseChunk``; ``chunk.content`` views ``data``."""
    out = DenseChunkView()
    for number, wire, value in _fields(memoryview(data)):
        if number == 1 and wire == 0:
            out.initialized = bool(value)
        elif number == 2 and wire == 0:
            out.version = _signed(value)
        elif number == 3 and wire == 2:
            out.chunk = _parse_tensor_chunk(value)
        elif number == 4 and wire == 0:
            out.is_buffer = bool(value)
    return out


@dataclass
class GradientChunkView:
    version: int = 0
    worker_id: int = 0
    learning_rate: float = 0.0
    dense: Optional[ChunkView] = None
    sparse: Optional[pb.EmbeddingRows] = None
    buffer: Optional[pb.Tensor] = None
    task_id: int = 0
    minibatch: int = 0
    num_records: int = 0
    epoch: int = 0
    grad_scale: float = 0.0
    discard: bool = False
    lr_reductions: int = 0
    lr_scale: float = 0.0       # 0: 1.0
    sync_group: int = 0
    error: str = ""  # set by parse_gradient_chunk_or_error instead of raising


def parse_gradient_chunk(data: bytes) -> GradientChunkView:
    """Parse a serialised ``GradientChunk``; ``dense.content`` views ``data``.

    Raises:
        ValueError: malformed bytes (the server answers INVALID_ARGUMENT).
    """
    out = GradientChunkView()
    for number, wire, value in _fields(memoryview(data)):
        if number == 1 and wire == 0:
            out.version = _signed(value)
        elif number == 2 and wire == 0:
            out.worker_id = _signed(value)
        elif number == 3 and wire == 5:
            out.learning_rate = struct.unpack("<f", value)[0]
        elif number == 4 and wire == 2:
            out.dense = _parse_tensor_chunk(value)
        elif number == 5 and wire == 2:
            out.sparse = _sub(pb.EmbeddingRows, value)
        elif number == 6 and wire == 2:
            out.buffer = _sub(pb.Tensor, value)
        elif number == 7 and wire == 0:
            out.task_id = _signed(value)
        elif number == 8 and wire == 0:
            out.minibatch = _signed(value)
        elif number == 9 and wire == 0:
            out.num_records = _signed(value)
        elif number == 10 and wire == 0:
            out.epoch = _signed(value)
        elif number == 11 and wire == 5:
            out.grad_scale = struct.unpack("<f", value)[0]
        elif number == 12 and wire == 0:
            out.discard = bool(value)
        elif number == 90 and wire == 0:
            out.lr_reductions = _signed(value)
        elif number == 91 and wire == 1:
            out.lr_scale = struct.unpack("<d", value)[0]
        elif number == 93 and wire == 0:
            out.sync_group = _signed(value)
    return out


def _sub(cls, value: memoryview):
    try:
        return cls.FromString(bytes(value))
    except DecodeError as e:
        raise ValueError(f"malformed {cls.__name__}: {e}") from None


def parse_gradient_chunk_or_error(data: bytes) -> GradientChunkView:
    """As :func:`parse_gradient_chunk`, but a malformed message comes back with
    ``error`` set (a gRPC deserializer that raises yields INTERNAL; the servicer
    turns ``error`` into INVALID_ARGUMENT)."""
    try:
        return parse_gradient_chunk(data)
    except ValueError as e:
        return GradientChunkView(error=str(e))


def serialize(message: object) -> bytes:
    """gRPC serializer that passes pre-serialised bytes through."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()  # type: ignore[attr-defined]
