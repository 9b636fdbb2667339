"""Request generators of the RPC fuzzer (see fuzz_harness.py): random messages from
the descriptors, edge values, valid templates mutated in one or two fields,
broken chunk streams and undecodable bytes."""

from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np

from elasticdl.common import chunk_wire
from elasticdl.common.tables import TableSpec
from elasticdl.proto import elasticdl_pb2 as pb

DENSE = {"w": (64, 32), "b": (32,)}
TABLE = TableSpec(name="emb", num_embeddings=1000, dim=8, initializer="normal:0.1", seed=1)


class Generator:
    """Random, edge-case and mutated requests."""

    def __init__(self, rng: random.Random, target: Any):
        self.rng = rng
        self.t = target

    def int64(self) -> int:
        r = self.rng
        version = self.t.shard.version
        return r.choice([0, 1, 2, 3, -1, -2, 7, 10, 99, 1000, 2 ** 31 - 1, 2 ** 31,
                         2 ** 62, 2 ** 63 - 1, -(2 ** 63), version, version + 1,
                         version - 1, 64 << 10, 64 << 20, r.randint(-10 ** 6, 10 ** 6)])

    def text(self, name: str) -> str:
        r = self.rng
        choices = {"name": ["w", "b", "steps", "emb", "", "nope"], "table": ["emb", "", "x"],
                   "dtype": ["float32", "int64", "float16", "float64", "bool", "bogus", ""],
                   "host": ["127.0.0.1", "", "evil", "h" * 300],
                   "initializer": ["normal", "zeros", "uniform:-1:1", "bogus:x"]}
        pool = choices.get(name, ["", "x", "acc"])
        if r.random() < 0.05:
            return "z" * r.choice([257, 70_000])
        return r.choice(pool)

    def content(self) -> bytes:
        r = self.rng
        n = r.choice([0, 1, 3, 4, 8, 32 * 4, 64 * 32 * 4, 64 * 32 * 4 - 1, 8 * 4 * 3,
                      r.randint(0, 1 << 16)])
        return r.randbytes(n)

    def shape(self) -> list[int]:
        r = self.rng
        return r.choice([[64, 32], [32], [], [0], [-1], [1 << 40], [64, 32, 1], [3, 8],
                         [2 ** 31, 2 ** 31], [r.randint(-3, 100)]])

    def message(self, desc: Any, depth: int = 0) -> Any:
        """A message of ``desc`` with random fields."""
        msg = getattr(pb, desc.name)()
        for f in desc.fields:
            if self.rng.random() < 0.3:
                continue
            if f.is_repeated and f.message_type is None:
                n = self.rng.choice([0, 1, 2, 5])
                if f.name == "shape":
                    getattr(msg, f.name).extend(self.shape())
                else:
                    getattr(msg, f.name).extend(self.scalar(f) for _ in range(n))
            elif f.is_repeated:
                if f.message_type.GetOptions().map_entry:
                    continue
                for _ in range(self.rng.choice([0, 1, 2]) if depth < 3 else 0):
                    getattr(msg, f.name).add().CopyFrom(self.message(f.message_type, depth + 1))
            elif f.message_type is not None:
                if depth < 3:
                    getattr(msg, f.name).CopyFrom(self.message(f.message_type, depth + 1))
            else:
                setattr(msg, f.name, self.scalar(f))
        return msg

    def scalar(self, f: Any) -> Any:
        t = f.type
        if t in (f.TYPE_INT64, f.TYPE_INT32, f.TYPE_SINT64, f.TYPE_ENUM):
            v = self.int64()
            if t == f.TYPE_ENUM:
                return self.rng.choice([0, 1, 2, 3, 4, 5, 99, -1])
            return v if t != f.TYPE_INT32 else max(-(2 ** 31), min(2 ** 31 - 1, v))
        if t in (f.TYPE_DOUBLE, f.TYPE_FLOAT):
            return self.rng.choice([0.0, 0.1, -1.0, 1e30, float("inf"), float("nan"), 1e7])
        if t == f.TYPE_BOOL:
            return self.rng.random() < 0.5
        if t == f.TYPE_BYTES:
            return self.content()
        return self.text(f.name)

    # templates: valid requests to mutate, so fuzzing reaches past the first check
    def tensor(self, name: str, shape: tuple[int, ...]) -> pb.Tensor:
        return pb.Tensor(name=name, dtype="float32", shape=list(shape),
                         content=np.zeros(shape, np.float32).tobytes())

    def template(self, method: str) -> Optional[Any]:
        v = self.t.shard.version
        if method == "push_gradients":
            return pb.PushGradientsRequest(
                version=v, worker_id=1, dense=[self.tensor(n, s) for n, s in DENSE.items()],
                sparse=[pb.EmbeddingRows(table="emb", ids=[1, 5],
                                         values=self.tensor("", (2, 8)))])
        if method == "pull_embedding":
            return pb.PullEmbeddingRequest(table="emb", ids=[0, 3, 999])
        if method in ("pull_dense", "pull_dense_chunks"):
            return pb.PullDenseRequest(version=-1, chunk_bytes=64 << 10)
        if method == "report_evaluation_metrics":
            return pb.ReportEvaluationMetricsRequest(
                worker_id=1, task_id=0, model_version=0,
                metrics=[pb.MetricValue(name="acc", value=0.5, weight=10)])
        if method == "join":
            return pb.JoinRequest(worker_id=1, host="127.0.0.1", port=5000)
        return None

    def mutate(self, msg: Any) -> Any:
        """Change 1-2 fields of ``msg`` (possibly deep) to random values."""
        for _ in range(self.rng.choice([1, 2])):
            target = msg
            while True:
                fields = [f for f in target.DESCRIPTOR.fields
                          if not (f.message_type and f.message_type.GetOptions().map_entry)]
                f = self.rng.choice(fields)
                if f.message_type is not None and not f.is_repeated and \
                        self.rng.random() < 0.5:
                    target = getattr(target, f.name)
                    continue
                if f.message_type is not None and f.is_repeated:
                    items = getattr(target, f.name)
                    if len(items) and self.rng.random() < 0.6:
                        target = items[self.rng.randrange(len(items))]
                        continue
                    target.ClearField(f.name)
                    items.add().CopyFrom(self.message(f.message_type, 2))
                elif f.is_repeated:
                    target.ClearField(f.name)
                    if f.name == "shape":
                        getattr(target, f.name).extend(self.shape())
                    else:
                        getattr(target, f.name).extend(self.scalar(f) for _ in range(
                            self.rng.choice([0, 1, 3])))
                elif f.message_type is not None:
                    getattr(target, f.name).CopyFrom(self.message(f.message_type, 2))
                else:
                    setattr(target, f.name, self.scalar(f))
                break
        return msg

    def gradient_stream(self) -> list[bytes]:
        """A push_gradient_chunks stream: valid, then broken in one way (or not)."""
        r = self.rng
        msgs: list[bytes] = []
        header: Optional[dict] = {"version": self.t.shard.version, "worker_id": 1,
                                  "learning_rate": 0.0}
        for name, shape in DENSE.items():
            t = np.zeros(shape, np.float32)
            for _, parts in chunk_wire.tensor_chunks_wire(name, t.reshape(-1).view(np.uint8),
                                                          "float32", shape, 1024):
                msgs.append(chunk_wire.gradient_chunk_bytes(parts, **(header or {})))
                header = None
        how = r.choice(["valid", "truncate", "drop", "swap", "dup", "garbage", "cut",
                        "empty", "mutate"])
        if how == "truncate":
            msgs = msgs[:r.randrange(len(msgs))]
        elif how == "drop":
            del msgs[r.randrange(len(msgs))]
        elif how == "swap" and len(msgs) > 2:
            i = r.randrange(len(msgs) - 1)
            msgs[i], msgs[i + 1] = msgs[i + 1], msgs[i]
        elif how == "dup":
            msgs.insert(r.randrange(len(msgs)), msgs[r.randrange(len(msgs))])
        elif how == "garbage":
            msgs.insert(r.randrange(len(msgs) + 1), r.randbytes(r.randint(0, 300)))
        elif how == "cut":
            i = r.randrange(len(msgs))
            msgs[i] = msgs[i][:r.randrange(len(msgs[i]))]
        elif how == "empty":
            msgs = []
        elif how == "mutate":
            msg = pb.GradientChunk.FromString(msgs[0])
            msgs[0] = self.mutate(msg).SerializeToString()
        return msgs

    def raw(self, msg: Any) -> bytes:
        """Undecodable or odd bytes derived from ``msg``."""
        data = bytearray(msg.SerializeToString())
        how = self.rng.choice(["cut", "flip", "garbage", "varint"])
        if how == "cut" and data:
            return bytes(data[:self.rng.randrange(len(data))])
        if how == "flip" and data:
            for _ in range(self.rng.randint(1, 4)):
                data[self.rng.randrange(len(data))] = self.rng.randrange(256)
            return bytes(data)
        if how == "varint":
            return b"\x08" + b"\xff" * 11  # an overlong varint
        return self.rng.randbytes(self.rng.randint(0, 200))
