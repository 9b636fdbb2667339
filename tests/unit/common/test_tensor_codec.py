"""tensor <-> proto round trips, chunking and validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elasticdl.common import tensor_codec as codec
from elasticdl.proto import elasticdl_pb2 as pb

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int8, torch.uint8, torch.bool]


def _sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype(dtype):
    t = _sample(dtype)
    msg = codec.encode(t, "w")
    assert msg.dtype == codec.dtype_name(dtype) and list(msg.shape) == [3, 5]
    back = codec.decode(pb.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == dtype and torch.equal(back, t)
    back[0, 0] = back[0, 0]  # writable


def test_round_trip_scalar_empty_noncontiguous_numpy():
    assert torch.equal(codec.decode(codec.encode(torch.tensor(3.5))), torch.tensor(3.5))
    empty = torch.zeros(0, 4)
    assert codec.decode(codec.encode(empty)).shape == (0, 4)
    t = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(codec.decode(codec.encode(t)), t)
    arr = np.arange(6, dtype=np.int64).reshape(2, 3)
    assert torch.equal(codec.decode(codec.encode(arr)), torch.from_numpy(arr))


def test_decode_into_writes_destination_memory():
    src = torch.randn(4, 3)
    dest = torch.zeros(4, 3)
    ptr = dest.data_ptr()
    codec.decode_into(codec.encode(src, "w"), dest)
    assert dest.data_ptr() == ptr and torch.equal(dest, src)
    with pytest.raises(ValueError, match="shape"):
        codec.decode_into(codec.encode(torch.randn(3, 4), "w"), dest)
    with pytest.raises(ValueError, match="dtype"):
        codec.decode_into(codec.encode(torch.randn(4, 3).double(), "w"), dest)


@pytest.mark.parametrize("bad, match", [
    (pb.Tensor(name="x", dtype="complex64", shape=[1], content=b"\0" * 8), "unknown dtype"),
    (pb.Tensor(name="x", dtype="float32", shape=[2], content=b"\0" * 4), "content bytes"),
    (pb.Tensor(name="x", dtype="float32", shape=[-1], content=b""), "negative"),
])
def test_decode_rejects_malformed(bad, match):
    with pytest.raises(ValueError, match=match):
        codec.decode(bad)


def test_decode_checks_expectations():
    msg = codec.encode(torch.zeros(2, 2), "w")
    with pytest.raises(ValueError, match="'w'.*shape"):
        codec.decode(msg, expected_shape=[4])
    with pytest.raises(ValueError, match="dtype"):
        codec.decode(msg, expected_dtype=torch.float64)
    with pytest.raises(ValueError, match="cannot travel"):
        codec.dtype_name(torch.complex64)


def test_ids_round_trip_and_validation():
    ids = np.array([5, 1, 9], dtype=np.int64)
    assert np.array_equal(codec.decode_ids(codec.encode_ids(ids)), ids)
    assert np.array_equal(codec.decode_ids(codec.encode_ids(torch.tensor([[1, 2]]))), [1, 2])
    with pytest.raises(ValueError, match="int64"):
        codec.decode_ids(codec.encode(torch.tensor([1, 2], dtype=torch.int32)))
    with pytest.raises(ValueError, match="1-D"):
        codec.decode_ids(codec.encode(torch.zeros(2, 2, dtype=torch.int64)))


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1 << 20])
def test_chunks_reassemble(chunk_bytes):
    a, b = torch.randn(10, 3), torch.arange(5, dtype=torch.int64)
    asm = codec.ChunkAssembler()
    done = []
    for name, t in (("a", a), ("b", b)):
        chunks = list(codec.iter_chunks(name, t, chunk_bytes))
        assert all(len(c.content) <= chunk_bytes for c in chunks)
        for c in chunks:
            finished = asm.add(pb.TensorChunk.FromString(c.SerializeToString()))
            if finished:
                done.append(finished)
    out = asm.result()
    assert done == ["a", "b"] and torch.equal(out["a"], a) and torch.equal(out["b"], b)


def test_chunks_into_destinations_and_empty_tensor():
    dest = {"w": torch.zeros(1000), "e": torch.zeros(0)}
    src = torch.randn(1000)
    asm = codec.ChunkAssembler(destinations=dest)
    for c in list(codec.iter_chunks("w", src, 512)) + list(codec.iter_chunks("e", dest["e"])):
        asm.add(c)
    asm.result()
    assert torch.equal(dest["w"], src)


def test_chunk_assembler_validation():
    chunks = list(codec.iter_chunks("w", torch.randn(100), 64))
    asm = codec.ChunkAssembler(expected={"w": (torch.float32, [100])})
    with pytest.raises(ValueError, match="offset"):
        asm.add(chunks[1])
    asm = codec.ChunkAssembler(expected={"w": (torch.float32, [100])})
    asm.add(chunks[0])
    with pytest.raises(ValueError, match="incomplete"):
        asm.result()
    with pytest.raises(ValueError, match="unknown name"):
        codec.ChunkAssembler(expected={}).add(chunks[0])
    with pytest.raises(ValueError, match="shape"):
        codec.ChunkAssembler(expected={"w": (torch.float32, [99])}).add(chunks[0])
    lying = pb.TensorChunk(name="w", dtype="float32", shape=[100], offset=0, total_bytes=12,
                           content=b"")
    with pytest.raises(ValueError, match="total_bytes"):
        codec.ChunkAssembler().add(lying)
    over = pb.TensorChunk(name="w", dtype="float32", shape=[1], offset=0, total_bytes=4,
                          content=b"\0" * 8)
    with pytest.raises(ValueError, match="overflows"):
        codec.ChunkAssembler().add(over)
    with pytest.raises(ValueError, match="chunk_bytes"):
        list(codec.iter_chunks("w", torch.zeros(1), 0))


# ------------------------------------------------------------ chunk_wire
def test_chunk_wire_bytes_are_the_protobuf_wire_format():
    from elasticdl.common import chunk_wire

    t = torch.randn(3, 5)
    view = codec.byte_view(t)
    [(offset, parts)] = chunk_wire.tensor_chunks_wire("w", view, "float32", (3, 5), 1 << 20)
    raw = chunk_wire.gradient_chunk_bytes(parts, version=-7, worker_id=3, learning_rate=0.25)
    msg = pb.GradientChunk.FromString(raw)
    assert (msg.version, msg.worker_id, msg.learning_rate) == (-7, 3, 0.25)
    assert codec.decode(pb.Tensor(dtype=msg.dense.dtype, shape=msg.dense.shape,
                                  content=msg.dense.content)).equal(t)
    # and the parser reads what the generated classes write
    ref = pb.GradientChunk(version=-7, worker_id=3, learning_rate=0.25,
                           dense=next(codec.iter_chunks("w", t)),
                           buffer=codec.encode(torch.tensor(1), "b"))
    view_msg = chunk_wire.parse_gradient_chunk(ref.SerializeToString())
    assert (view_msg.version, view_msg.worker_id, view_msg.learning_rate) == (-7, 3, 0.25)
    assert view_msg.dense.shape == (3, 5) and bytes(view_msg.dense.content) == to_b(t)
    assert view_msg.buffer.name == "b" and view_msg.sparse is None
    dense = chunk_wire.dense_chunk_bytes(True, 9, True, parts)
    parsed = chunk_wire.parse_dense_chunk(dense)
    assert parsed.initialized and parsed.version == 9 and parsed.is_buffer
    assert pb.DenseChunk.FromString(dense).chunk.total_bytes == 60
    assert chunk_wire.parse_dense_chunk(chunk_wire.dense_chunk_bytes(False, 2, False, None)) \
        .chunk is None


def to_b(t: torch.Tensor) -> bytes:
    return codec.to_bytes(t)


@pytest.mark.parametrize("raw", [b"\x08", b"\x22\x10abc", b"\x0f", b"\x08\xff\xff\xff\xff\xff"
                                 b"\xff\xff\xff\xff\xff\xff"])
def test_chunk_wire_rejects_malformed(raw):
    from elasticdl.common import chunk_wire

    with pytest.raises(ValueError, match="malformed"):
        chunk_wire.parse_gradient_chunk(raw)


def test_whole_chunk_view_is_zero_copy_and_checked():
    from elasticdl.common import chunk_wire

    t = torch.randn(4, 2)
    raw = chunk_wire.gradient_chunk_bytes(
        chunk_wire.tensor_chunks_wire("w", codec.byte_view(t), "float32", (4, 2), 1 << 20)[0][1])
    chunk = chunk_wire.parse_gradient_chunk(raw).dense
    got = codec.whole_chunk_view(chunk, {"w": (torch.float32, [4, 2])})
    assert got is not None and torch.equal(got, t)
    with pytest.raises(ValueError, match="shape"):
        codec.whole_chunk_view(chunk, {"w": (torch.float32, [8])})
    with pytest.raises(ValueError, match="unknown"):
        codec.whole_chunk_view(chunk, {})
    part = next(codec.iter_chunks("w", t, 8))
    assert codec.whole_chunk_view(part, {"w": (torch.float32, [4, 2])}) is None
