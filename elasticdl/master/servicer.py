"""The master's gRPC service (DESIGN §3), validating every request.

Invalid requests (negative worker ids, unknown task types, non-finite
metrics, ...) are answered with ``INVALID_ARGUMENT`` and a message; the
master keeps serving. The servicer only translates: the task manager, the
evaluation aggregator, the rendezvous and the job controller do the work.
"""

from __future__ import annotations

import logging
import math
import threading
from concurrent import futures
from typing import Any, Optional, Protocol

import grpc

from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.task_manager import Task, TaskManager, TaskType
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
]


class JobHooks(Protocol):
    """What the servicer tells the job controller."""

    def on_version(self, worker_id: int, version: int) -> None: ...

    def on_worker_failure(self, worker_id: int, message: str, traceback: str) -> None: ...

    def claim_export(self, worker_id: int) -> bool: ...



class _Invalid(Exception):
    pass


def task_to_proto(task: Task) -> pb.Task:
    return pb.Task(task_id=task.task_id, type=int(task.type),  # type: ignore[arg-type]
                   shard=pb.Shard(name=task.shard_name, start=task.start, end=task.end),
                   model_version=task.model_version, epoch=task.epoch)


def task_from_proto(msg: pb.Task) -> Task:
    return Task(msg.task_id, TaskType(msg.type), msg.shard.name, msg.shard.start,
                msg.shard.end, msg.epoch, msg.model_version)


def _worker(worker_id: int) -> int:
    if worker_id < 0:
        raise _Invalid(f"worker_id must be >= 0, got {worker_id}")
    return worker_id


def _validated(method):
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except _Invalid as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    wrapper.__name__ = method.__name__
    return wrapper


class MasterServicer(pb_grpc.MasterServicer):
    def __init__(self, task_manager: TaskManager, aggregator: EvaluationAggregator,
                 hooks: JobHooks, rendezvous: Optional[Any] = None):
        self.task_manager = task_manager
        self.aggregator = aggregator
        self.hooks = hooks
        self.rendezvous = rendezvous

    @_validated
    def get_task(self, request: pb.GetTaskRequest, context: Any) -> pb.Task:
        worker_id = _worker(request.worker_id)
        if request.task_type not in (pb.NONE, pb.TRAINING, pb.EVALUATION, pb.PREDICTION):
            raise _Invalid(f"cannot ask for task type {request.task_type}")
        wanted = None if request.task_type == pb.NONE else TaskType(request.task_type)
        task = self.task_manager.get(worker_id, wanted)
        msg = task_to_proto(task)
        if task.type == TaskType.NONE and self.task_manager.finished() and \
                self.hooks.claim_export(worker_id):
            msg.extended_config["export_model"] = "true"
        return msg

    @_validated
    def report_task_result(self, request: pb.ReportTaskResultRequest, context: Any) -> pb.Empty:
        worker_id = _worker(request.worker_id)
        if request.task_id < 0:
            raise _Invalid(f"task_id must be >= 0, got {request.task_id}")
        ok = not request.err_message
        self.task_manager.report(request.task_id, worker_id, ok, request.err_message,
                                 request.err_traceback, request.fatal)
        return pb.Empty()

    @_validated
    def report_evaluation_metrics(self, request: pb.ReportEvaluationMetricsRequest,
                                  context: Any) -> pb.Empty:
        _worker(request.worker_id)
        metrics = []
        for m in request.metrics:
            if not m.name:
                raise _Invalid("metric without a name")
            if not math.isfinite(m.value):
                raise _Invalid(f"metric {m.name} is not finite: {m.value}")
            if m.weight < 0:
                raise _Invalid(f"metric {m.name} has negative weight {m.weight}")
            metrics.append((m.name, m.value, m.weight))
        self.aggregator.add(request.model_version, request.task_id, metrics)
        return pb.Empty()

    @_validated
    def report_version(self, request: pb.ReportVersionRequest, context: Any) -> pb.Empty:
        worker_id = _worker(request.worker_id)
        if request.model_version < 0:
            raise _Invalid(f"model_version must be >= 0, got {request.model_version}")
        self.hooks.on_version(worker_id, request.model_version)
        return pb.Empty()

    @_validated
    def report_failure(self, request: pb.ReportFailureRequest, context: Any) -> pb.Empty:
        worker_id = _worker(request.worker_id)
        self.hooks.on_worker_failure(worker_id, request.err_message, request.err_traceback)
        return pb.Empty()

    def _rdzv(self) -> Any:
        if self.rendezvous is None:
            raise _Invalid("this job has no rendezvous (not AllreduceStrategy)")
        return self.rendezvous

    @staticmethod
    def _plan(plan: Any) -> pb.CommPlan:
        return pb.CommPlan(plan_version=plan.plan_version, rank=plan.rank,
                           world_size=plan.world_size, peer_addresses=list(plan.peer_addresses),
                           master_addr=plan.master_addr, master_port=plan.master_port,
                           ready=plan.ready, aborting=plan.aborting)

    @_validated
    def join(self, request: pb.JoinRequest, context: Any) -> pb.CommPlan:
        worker_id = _worker(request.worker_id)
        if not request.host or not 0 <= request.port < 65536:
            raise _Invalid(f"join needs a host and a port in 0..65535 (0: none), got "
                           f"{request.host!r}:{request.port}")
        return self._plan(self._rdzv().join(worker_id, request.host, request.port))

    @_validated
    def get_comm_plan(self, request: pb.CommPlanRequest, context: Any) -> pb.CommPlan:
        return self._plan(self._rdzv().get_comm_plan(_worker(request.worker_id),
                                                      request.known_plan_version))

    @_validated
    def report_collective_failure(self, request: pb.CollectiveFailureRequest,
                                  context: Any) -> pb.CommPlan:
        worker_id = _worker(request.worker_id)
        return self._plan(self._rdzv().report_failure(worker_id, request.plan_version,
                                                      request.reason))

    def echo(self, request: pb.Empty, context: Any) -> pb.Empty:
        return pb.Empty()


def start_master_server(servicer: MasterServicer, port: int, host: str = "[::]",
                        max_workers: int = 64) -> grpc.Server:
    """Serve the master on ``host:port``; raises RuntimeError if the port is taken."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="master-rpc"),
                         options=GRPC_OPTIONS)
    pb_grpc.add_MasterServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"master cannot bind port {port}")
    server.start()
    logger.info("master serving on port %d", bound)
    return server


class NullHooks:
    """Hooks that do nothing (benchmarks, unit tests)."""

    def __init__(self) -> None:
        self._export = threading.Lock()
        self._claimed = False

    def on_version(self, worker_id: int, version: int) -> None:
        pass

    def on_worker_failure(self, worker_id: int, message: str, traceback: str) -> None:
        pass

    def claim_export(self, worker_id: int) -> bool:
        with self._export:
            first, self._claimed = not self._claimed, True
            return first
