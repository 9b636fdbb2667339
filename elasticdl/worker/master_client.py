"""The worker's gRPC client of the master; a :class:`TaskSource`.

Every call has a deadline. ``UNAVAILABLE`` and ``DEADLINE_EXCEEDED`` (the
master restarting or busy) are retried with backoff for up to
``unavailable_timeout_s``; after that :class:`ConnectionError` is raised and
the worker exits, so no worker outlives its master for long.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, TypeVar

import grpc

from elasticdl.common import auth
from elasticdl.common.task import Task, TaskType
from elasticdl.common.wire import GRPC_OPTIONS, task_from_proto
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc
from elasticdl.worker.task_source import Metric, TaskSource

logger = logging.getLogger(__name__)

T = TypeVar("T")
# CANCELLED: a master going away (its pod deleted, a graceful stop under way) ended a
# call in flight with it on the Kubernetes tier; this client never cancels its own
# calls, so the code can only come from the master's side, and every request is safe
# to repeat (request_id; a retried get_tasks gets the same lease)
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.CANCELLED)


class ReportRefused(RuntimeError):
    """The master refused task results of a batch (the message says which and why)."""


def _check_refused(refused: Sequence[pb.ReportRefusal]) -> None:
    if refused:
        raise ReportRefused("the master refused task result(s): " + "; ".join(
            f"task {r.task_id}: {'invalid' if r.invalid else 'denied'}: {r.reason}"
            for r in refused))


def _unimplemented(e: grpc.RpcError) -> bool:
    return hasattr(e, "code") and e.code() == grpc.StatusCode.UNIMPLEMENTED


class MasterClient(TaskSource):
    def __init__(self, master_addr: str, worker_id: int, call_timeout_s: float = 30.0,
                 unavailable_timeout_s: float = 60.0):
        self.master_addr = master_addr
        self.worker_id = worker_id
        self.call_timeout_s = call_timeout_s
        self.unavailable_timeout_s = unavailable_timeout_s
        self._channel = auth.client_channel(master_addr, GRPC_OPTIONS,
                                            replica=f"worker-{worker_id}")
        self._stub = pb_grpc.MasterStub(self._channel)
        self.export_model = False
        # the final checkpoint to load before exporting (this worker did not train)
        self.export_from = ""
        # with the export order (allreduce): the master's closed tasks, (generation, flat)
        self.export_closed: Optional[tuple[int, tuple[int, ...]]] = None
        self._request_id = 0
        self._leases = True   # False once the master answered UNIMPLEMENTED (older one)
        # the worker's model version, sent with every task result (set once the
        # trainer exists)
        self.version: Optional[Callable[[], int]] = None

    def close(self) -> None:
        self._channel.close()

    def _call(self, fn: Callable[..., T], request: Any) -> T:
        deadline = time.monotonic() + self.unavailable_timeout_s
        delay = 0.1
        while True:
            # no attempt runs past the deadline: a dead master costs at most
            # unavailable_timeout_s per call, not that plus call_timeout_s
            timeout = max(0.5, min(self.call_timeout_s, deadline - time.monotonic()))
            try:
                return fn(request, timeout=timeout)
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if code not in RETRYABLE:
                    raise
                if time.monotonic() >= deadline:
                    raise ConnectionError(
                        f"master {self.master_addr} unreachable for "
                        f"{self.unavailable_timeout_s:.0f} s: {code}") from e
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def get_task(self, task_type: Optional[TaskType] = None) -> Task:
        """The next task. A retry (lost reply, deadline) resends the same
        ``request_id``, so the master hands out the same task again and none is
        orphaned."""
        wanted: Any = int(task_type) if task_type is not None else pb.NONE
        self._request_id += 1
        req = pb.GetTaskRequest(worker_id=self.worker_id, task_type=wanted,
                                request_id=self._request_id)
        msg = self._call(self._stub.get_task, req)
        self._note_export(msg)
        return task_from_proto(msg)

    def report_request(self, task: Task, error: str = "", traceback: str = "",
                       fatal: bool = False, counters: Optional[Mapping[str, int]] = None,
                       loss: Optional[float] = None, learning_rate: Optional[float] = None
                       ) -> pb.ReportTaskResultRequest:
        """A task's result as sent, with the worker's model version now."""
        req = pb.ReportTaskResultRequest(
            task_id=task.task_id, worker_id=self.worker_id, err_message=error[:16000],
            err_traceback=traceback[-20000:], fatal=fatal,
            counters=[pb.Counter(name=n, value=int(v)) for n, v in (counters or {}).items()])
        if self.version is not None:
            req.model_version = max(int(self.version()), 0)
        if loss is not None and math.isfinite(loss):
            req.loss = float(loss)
        if learning_rate is not None:
            req.learning_rate = float(learning_rate)
        return req

    def report_task(self, task: Task, error: str = "", traceback: str = "",
                    fatal: bool = False, counters: Optional[Mapping[str, int]] = None,
                    loss: Optional[float] = None, learning_rate: Optional[float] = None
                    ) -> None:
        self._call(self._stub.report_task_result,
                   self.report_request(task, error, traceback, fatal, counters, loss,
                                       learning_rate))

    def get_tasks(self, task_type: Optional[TaskType], max_tasks: int,
                  reports: Sequence[pb.ReportTaskResultRequest] = ()) -> list[Task]:
        """A lease of up to ``max_tasks`` tasks (or one WAIT / NONE), after the
        master applied and journaled ``reports`` (:meth:`report_request`). Call it
        only while holding no task (see :mod:`elasticdl.master.leases`); a retry
        gets the same lease.

        Raises:
            ReportRefused: the master refused some of ``reports``.
            ConnectionError: the master cannot be reached.
        """
        wanted: Any = int(task_type) if task_type is not None else pb.NONE
        if not self._leases:
            self.report_tasks(reports)
            return [self.get_task(task_type)]
        try:
            reply = self._call(self._stub.get_tasks, pb.GetTasksRequest(
                worker_id=self.worker_id, task_type=wanted, max_tasks=max_tasks,
                reports=list(reports)))
        except grpc.RpcError as e:
            if not _unimplemented(e):
                raise
            logger.info("the master serves no leases: one task per call")
            self._leases = False
            return self.get_tasks(task_type, max_tasks, reports)
        _check_refused(reply.refused)
        for m in reply.tasks:
            self._note_export(m)
        return [task_from_proto(m) for m in reply.tasks]

    def _note_export(self, msg: Any) -> None:
        """The master's export order, when a task message carries it."""
        if msg.extended_config.get("export_model") == "true":
            self.export_model = True
            self.export_from = msg.extended_config.get("export_from", "")
            if msg.has_closed:
                self.export_closed = (int(msg.closed_generation), tuple(msg.closed))

    def report_tasks(self, reports: Sequence[pb.ReportTaskResultRequest]) -> None:
        """Several task results in one call (applied and journaled in order).

        Raises:
            ReportRefused: the master refused some of them (the rest are applied).
        """
        if not reports:
            return
        if self._leases:
            try:
                reply = self._call(self._stub.report_task_results,
                                   pb.ReportTaskResultsRequest(worker_id=self.worker_id,
                                                               reports=list(reports)))
                _check_refused(reply.refused)
                return
            except grpc.RpcError as e:
                if not _unimplemented(e):
                    raise
                self._leases = False
        for r in reports:   # a master without batches (an older one)
            self._call(self._stub.report_task_result, r)

    def report_evaluation(self, task: Task, metrics: Sequence[Metric],
                          states: bytes = b"") -> None:
        self._call(self._stub.report_evaluation_metrics, pb.ReportEvaluationMetricsRequest(
            worker_id=self.worker_id, task_id=task.task_id, model_version=task.model_version,
            metrics=[pb.MetricValue(name=n, value=v, weight=w) for n, v, w in metrics],
            metric_states=states))

    def report_version(self, version: int) -> None:
        self._call(self._stub.report_version, pb.ReportVersionRequest(
            worker_id=self.worker_id, model_version=version))

    def report_failure(self, replica: str, message: str, traceback: str) -> None:
        self._call(self._stub.report_failure, pb.ReportFailureRequest(
            worker_id=self.worker_id, replica=replica, err_message=message[:16000],
            err_traceback=traceback[-20000:]))

    def report_export(self, path: str, model_version: int) -> None:
        """The final model is written at ``path`` (this worker held the export)."""
        self._call(self._stub.report_export, pb.ReportExportRequest(
            worker_id=self.worker_id, path=path, model_version=max(int(model_version), 0)))

    # rendezvous (AllreduceStrategy)
    def join(self, host: str, port: int) -> pb.CommPlan:
        return self._call(self._stub.join, pb.JoinRequest(worker_id=self.worker_id, host=host,
                                                          port=port))

    def get_comm_plan(self, known_version: int) -> pb.CommPlan:
        return self._call(self._stub.get_comm_plan, pb.CommPlanRequest(
            worker_id=self.worker_id, known_plan_version=known_version))

    def report_collective_failure(self, plan_version: int, reason: str) -> pb.CommPlan:
        return self._call(self._stub.report_collective_failure, pb.CollectiveFailureRequest(
            worker_id=self.worker_id, plan_version=plan_version, reason=reason))

    def echo(self) -> None:
        self._call(self._stub.echo, pb.Empty())
