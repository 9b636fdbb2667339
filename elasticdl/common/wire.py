"""Wire conventions shared by every gRPC endpoint: channel/server options and the
conversions between protobuf messages and the job's plain objects."""

from __future__ import annotations

from elasticdl.common.task import Task, TaskType
from elasticdl.proto import elasticdl_pb2 as pb

# Tensors travel in chunks of a few MiB, but a small model's unary pull or a
# push_model may be bigger: allow large messages. Frames are made large too so
# a chunk crosses HTTP/2 in few frames. One set for the master and the PS, on
# both ends of every channel.
GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.http2.max_frame_size", (1 << 24) - 1),
    ("grpc.so_reuseport", 0),
]


def task_to_proto(task: Task) -> pb.Task:
    shard = pb.Shard(name=task.shard_name, start=task.start, end=task.end)
    if task.span is not None:
        shard.byte_start, shard.byte_end, shard.num_fields = task.span
        shard.has_span = True
    return pb.Task(task_id=task.task_id, type=int(task.type),  # type: ignore[arg-type]
                   shard=shard,
                   model_version=task.model_version, epoch=task.epoch,
                   metric_states=list(task.metric_states), lr_reductions=task.lr_reductions,
                   lr_scale=task.lr_scale if task.lr_scale != 1.0 else 0.0,
                   sync_group=task.sync_group)


def task_from_proto(msg: pb.Task) -> Task:
    closed = (msg.closed_generation, tuple(msg.closed)) if msg.has_closed else None
    return Task(msg.task_id, TaskType(msg.type), msg.shard.name, msg.shard.start,
                msg.shard.end, msg.epoch, msg.model_version, tuple(msg.metric_states),
                lr_reductions=int(msg.lr_reductions), lr_scale=float(msg.lr_scale or 1.0),
                sync_group=int(msg.sync_group),
                closed=closed,
                span=(int(msg.shard.byte_start), int(msg.shard.byte_end),
                      int(msg.shard.num_fields)) if msg.shard.has_span else None)
