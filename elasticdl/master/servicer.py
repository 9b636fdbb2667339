"""The master's gRPC service, validating every request.

Invalid requests (negative worker ids, unknown task types, non-finite
metrics, ...) are answered with ``INVALID_ARGUMENT`` and a message; the
master keeps serving. The servicer only translates: the job core
(:class:`JobCore`: tasks, evaluations, versions, bookkeeping) and the
rendezvous do the work.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from concurrent import futures
from typing import Any, Optional

import grpc

from elasticdl.checkpoint import staging
from elasticdl.common import auth, faults
from elasticdl.common.rpc_service import Malformed, abort_unexpected, add_service, short
from elasticdl.common.task import WAIT_TASK, Task, TaskType
from elasticdl.common.wire import GRPC_OPTIONS, task_to_proto
from elasticdl.master.core_types import TaskResult
from elasticdl.master.evaluation import MetricStateError
from elasticdl.master.job import JobCore
from elasticdl.master.leases import MAX_LEASE, LeaseBook
from elasticdl.master.ps_settle import ClosedSnapshot
from elasticdl.master.rendezvous import MemberConflict, RendezvousHandler
from elasticdl.master.versions import VersionError
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


# what report_task_result may carry (see TaskManager.report)
COUNTERS = frozenset({"records_applied", "applied_at_version", "applied_generation",
                      "records_read",
                      "records_skipped", "nonfinite_steps_skipped",
                      "collapsed_records", "collapsed_at_version", "alive_at_version"})
MAX_COUNTER = (1 << 53) - 1


class _Invalid(Exception):
    pass


class _Denied(Exception):
    """The caller may not do this (not the task's holder, another worker's id)."""


MAX_WORKER_ID = (1 << 31) - 1
MAX_VERSION = (1 << 53) - 1
MAX_TEXT = 64 << 10        # error messages, tracebacks, reasons
MAX_ITEMS = 1000           # counters, metrics
MAX_NAME = 256             # metric/counter names, hosts


def _worker(worker_id: int) -> int:
    if not 0 <= worker_id <= MAX_WORKER_ID:
        raise _Invalid(f"worker_id must be in [0, {MAX_WORKER_ID}], got {worker_id}")
    return worker_id


def _text(what: str, value: str, limit: int = MAX_TEXT) -> str:
    if len(value) > limit:
        raise _Invalid(f"{what} longer than {limit} characters ({len(value)})")
    return value


def _version(version: int) -> int:
    if not 0 <= version <= MAX_VERSION:
        raise _Invalid(f"model_version must be in [0, {MAX_VERSION}], got {version}")
    return version


def _finite(what: str, value: float) -> float:
    if not math.isfinite(value):
        raise _Invalid(f"{what} must be finite, got {value}")
    return float(value)


def _count(what: str, n: int) -> None:
    if n > MAX_ITEMS:
        raise _Invalid(f"more than {MAX_ITEMS} {what} ({n})")


def _validated(method):
    """Map validation failures and internal errors to gRPC status codes; the
    master keeps serving either way."""
    def wrapper(self, request, context):
        try:
            if isinstance(request, Malformed):
                raise _Invalid(request.error)
            self._check_caller(request, context)
            with self.core.deferred_writes():
                reply = method(self, request, context)
            self.core.durable()  # every transition of this call on disk before the reply
            point = getattr(self._after_durable, "point", None)
            if point is not None:   # a fault point of the call: its records on disk, no reply
                self._after_durable.point = None
                faults.point(point)
            return reply
        except (_Invalid, VersionError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, short(str(e)))
        except _Denied as e:
            logger.warning("%s refused: %s", method.__name__, short(str(e), 300))
            context.abort(grpc.StatusCode.PERMISSION_DENIED, short(str(e)))
        except Exception as e:  # noqa: BLE001 - MemoryError or a bug: refused, clearly
            abort_unexpected(context, method.__name__, e, "master")
    wrapper.__name__ = method.__name__
    return wrapper


class MasterServicer(pb_grpc.MasterServicer):
    """Args:
        require_identity: every worker call must name its replica
            (``x-elasticdl-replica: worker-N``, set by the worker's channel) and
            ``N`` must be the request's ``worker_id``. Without it a declared
            replica is still checked.
    """

    def __init__(self, core: JobCore, rendezvous: Optional[RendezvousHandler] = None,
                 require_identity: bool = False):
        self.core = core
        core.group_commit = True  # journal records fsynced in groups, before each reply
        self.rendezvous = rendezvous
        self.require_identity = require_identity
        self._closed = ClosedSnapshot(core)   # sent to allreduce members with tasks
        self._after_durable = threading.local()  # .point: fired once the call is durable
        self._snapshotted_plan = -1
        self.leases = LeaseBook(core)

    def _check_caller(self, request: Any, context: Any) -> None:
        """A call about worker N must come from worker N's channel."""
        worker_id = getattr(request, "worker_id", None)
        if worker_id is None:
            return
        replica = auth.caller_replica(context)
        if replica is None:
            if self.require_identity:
                raise _Denied("the call names no replica (x-elasticdl-replica)")
            return
        if replica != f"worker-{worker_id}":
            raise _Denied(f"{replica} may not act as worker {worker_id}")

    @staticmethod
    def _wanted(task_type: int) -> Optional[TaskType]:
        if task_type not in (pb.NONE, pb.TRAINING, pb.EVALUATION, pb.PREDICTION):
            raise _Invalid(f"cannot ask for task type {task_type}")
        return None if task_type == pb.NONE else TaskType(task_type)

    def _span(self, task: Task) -> Optional[tuple[int, int, int]]:
        """The byte span of ``task``'s records where its reader is line-indexed."""
        reader = self.core.task_readers.get(task.type)
        span = getattr(reader, "span", None)
        return span(task.shard_name, task.start, task.end) if span is not None else None

    def _task_msg(self, task: Task, worker_id: int, per_call: Optional[dict] = None
                  ) -> pb.Task:
        """``per_call``: what every training task of one reply carries, read once
        per call (a lease of many tasks takes the core's lock once, not per task)."""
        span = self._span(task)   # line-indexed files: where the records are, from our index
        msg = task_to_proto(task if span is None else dataclasses.replace(task, span=span))
        if task.type == TaskType.TRAINING:
            if per_call is None:
                per_call = {}
            if "lr" not in per_call:   # fixed while a training task is out
                per_call["lr"] = self.core.lr_reductions()
                per_call["lr_scale"] = self.core.lr_scale()
                per_call["sync_group"] = self.core.sync_group()
            msg.lr_reductions = per_call["lr"]
            if per_call["lr_scale"] != 1.0:   # after a divergence rollback (0: 1.0)
                msg.lr_scale = per_call["lr_scale"]
            msg.sync_group = per_call["sync_group"]
            if self.rendezvous is not None:
                # allreduce members drop closed tasks from their trained-record sets
                if "closed" not in per_call:
                    per_call["closed"] = self._closed.get()
                msg.closed_generation, flat = per_call["closed"]
                msg.closed.extend(flat)
                msg.has_closed = True
        if task.type == TaskType.EVALUATION_FINALIZE:
            msg.metric_states.extend(self.core.evaluation_states(task.model_version))
        if task.type == TaskType.NONE:
            claimed = self.core.claim_export(worker_id)
            if claimed or self.core.exporter() == worker_id:
                msg.extended_config["export_model"] = "true"
                load = self.core.exporter_load()
                if load:   # it did not train: it loads the final checkpoint first
                    msg.extended_config["export_from"] = staging.to_url(load)
                elif self.rendezvous is not None:
                    # what the job closed, fresh (not the snapshot tasks carry, which may
                    # be older than the last tasks): the final checkpoint's data position
                    generation, closed = self.core.closed_tasks()
                    msg.closed_generation = generation
                    msg.closed.extend(closed.to_flat())
                    msg.has_closed = True
                if claimed:
                    self._after_durable.point = "after_export_claim"
            elif self.core.export_pending():
                # training is done, the final model not written yet: stay, in case the
                # exporter dies and this worker takes the export over
                msg = task_to_proto(WAIT_TASK)
        return msg

    @_validated
    def report_export(self, request: pb.ReportExportRequest, context: Any) -> pb.Empty:
        worker_id = _worker(request.worker_id)
        path = _text("path", request.path)
        if not self.core.export_written(worker_id, path):
            if self.core.exported == path:   # its retry after a lost reply (master restart)
                logger.info("worker %d reported its export of %s again: already recorded",
                            worker_id, path)
            else:
                logger.warning("worker %d reported an export it does not hold (replaced as "
                               "exporter?): ignored", worker_id)
        else:
            self._after_durable.point = "after_export_written"
        return pb.Empty()

    @_validated
    def get_task(self, request: pb.GetTaskRequest, context: Any) -> pb.Task:
        worker_id = _worker(request.worker_id)
        wanted = self._wanted(request.task_type)
        if self._retiring(worker_id):
            return task_to_proto(WAIT_TASK)  # retired by a resize: no new work
        task = self.core.get(worker_id, wanted, request_id=request.request_id)
        return self._task_msg(task, worker_id)

    def _retiring(self, worker_id: int) -> bool:
        scaling = self.core.attachments.get("scaling")
        return scaling is not None and scaling.is_retiring(worker_id)

    @_validated
    def report_task_result(self, request: pb.ReportTaskResultRequest, context: Any) -> pb.Empty:
        self._report(_worker(request.worker_id), request)
        return pb.Empty()

    def _report(self, worker_id: int, request: pb.ReportTaskResultRequest) -> None:
        """Validate one task result and hand it to the core (journaled). Raises
        _Invalid / _Denied (nothing recorded)."""
        for refusal in self.core.report_tasks(worker_id, [self._result(worker_id, request)]):
            raise (_Invalid if refusal.invalid else _Denied)(refusal.reason)

    @staticmethod
    def _result(worker_id: int, request: pb.ReportTaskResultRequest) -> TaskResult:
        """One task result, its fields validated (whether the task exists and the
        worker holds it is the core's check). Raises _Invalid / _Denied."""
        if request.worker_id != worker_id:
            raise _Denied(f"worker {worker_id} may not report for worker {request.worker_id}")
        _text("err_message", request.err_message)
        _text("err_traceback", request.err_traceback)
        _count("counters", len(request.counters))
        counters = {}
        for c in request.counters:
            if c.name not in COUNTERS or not 0 <= c.value <= MAX_COUNTER:
                raise _Invalid(f"counter {c.name!r}={c.value}: known counters are "
                               f"{sorted(COUNTERS)}, values 0..{MAX_COUNTER}")
            counters[c.name] = c.value
        version = None
        if request.HasField("model_version"):
            version = _version(request.model_version)
        loss = _finite("loss", request.loss) if request.HasField("loss") else None
        lr = _finite("learning_rate", request.learning_rate) \
            if request.HasField("learning_rate") else None
        return TaskResult(request.task_id, not request.err_message, request.err_message,
                          request.err_traceback, request.fatal, counters, version, loss, lr)

    def _reports(self, worker_id: int, reports: Any) -> list[pb.ReportRefusal]:
        """Apply a batch of task results in order, in one core call (one journal
        record); the ones refused (the rest are applied, so a batch is never
        half-acknowledged by an error)."""
        _count("reports", len(reports))
        refused = []
        valid: list[TaskResult] = []
        for r in reports:
            try:
                valid.append(self._result(worker_id, r))
            except _Invalid as e:
                refused.append(pb.ReportRefusal(task_id=r.task_id, reason=short(str(e)),
                                                invalid=True))
            except _Denied as e:
                logger.warning("report of task %d refused: %s", r.task_id, short(str(e), 300))
                refused.append(pb.ReportRefusal(task_id=r.task_id, reason=short(str(e))))
        for i, reason, invalid in self.core.report_tasks(worker_id, valid) if valid else ():
            if not invalid:
                logger.warning("report of task %d refused: %s", valid[i].task_id,
                               short(reason, 300))
            refused.append(pb.ReportRefusal(task_id=valid[i].task_id, reason=short(reason),
                                            invalid=invalid))
        return refused

    @_validated
    def report_task_results(self, request: pb.ReportTaskResultsRequest,
                            context: Any) -> pb.ReportTaskResultsResponse:
        refused = self._reports(_worker(request.worker_id), request.reports)
        return pb.ReportTaskResultsResponse(refused=refused)

    @_validated
    def get_tasks(self, request: pb.GetTasksRequest, context: Any) -> pb.TaskLease:
        worker_id = _worker(request.worker_id)
        wanted = self._wanted(request.task_type)
        if not 1 <= request.max_tasks <= MAX_LEASE:
            raise _Invalid(f"max_tasks must be in [1, {MAX_LEASE}], got {request.max_tasks}")
        refused = self._reports(worker_id, request.reports)
        if self._retiring(worker_id):   # retired by a resize: no new work
            return pb.TaskLease(tasks=[task_to_proto(WAIT_TASK)], refused=refused)
        tasks = self.leases.lease(worker_id, wanted, request.max_tasks)
        per_call: dict = {}
        return pb.TaskLease(tasks=[self._task_msg(t, worker_id, per_call) for t in tasks],
                            refused=refused)

    @_validated
    def report_evaluation_metrics(self, request: pb.ReportEvaluationMetricsRequest,
                                  context: Any) -> pb.Empty:
        worker_id = _worker(request.worker_id)
        self._known_task(request.task_id)
        _count("metrics", len(request.metrics))
        metrics = []
        for m in request.metrics:
            if not m.name or len(m.name) > MAX_NAME:
                raise _Invalid(f"metric name must have 1..{MAX_NAME} characters")
            if not math.isfinite(m.value):
                raise _Invalid(f"metric {m.name} is not finite: {m.value}")
            if m.weight < 0:
                raise _Invalid(f"metric {m.name} has negative weight {m.weight}")
            metrics.append((m.name, m.value, m.weight))
        task, holders = self.core.held_task(request.task_id)
        if task is None:  # finished (by a reassigned copy) or re-queued: nothing to add
            logger.info("metrics for task %d, held by nobody now, from worker %d: ignored",
                        request.task_id, worker_id)
            return pb.Empty()
        if worker_id not in holders:
            raise _Denied(f"worker {worker_id} does not hold task {request.task_id} "
                          f"(held by {sorted(holders)})")
        if task.type not in (TaskType.EVALUATION, TaskType.EVALUATION_FINALIZE):
            raise _Invalid(f"task {request.task_id} is not an evaluation task")
        if request.model_version != task.model_version:
            raise _Invalid(f"metrics for model version {request.model_version}, but task "
                           f"{request.task_id} evaluates version {task.model_version}")
        try:
            self.core.report_evaluation(request.task_id, request.model_version, metrics,
                                        request.metric_states)
        except MetricStateError as e:
            raise _Invalid(str(e)) from e
        return pb.Empty()

    @_validated
    def report_version(self, request: pb.ReportVersionRequest, context: Any) -> pb.Empty:
        worker_id = _worker(request.worker_id)
        version = _version(request.model_version)
        if not self.core.has_worked(worker_id):
            # a worker that never trained cannot have made a version; ignored, not an
            # error (a worker may end without ever getting a task)
            logger.warning("version %d from worker %d, which never had a task: ignored",
                           request.model_version, worker_id)
            return pb.Empty()
        self.core.on_version(worker_id, version)  # VersionError: INVALID_ARGUMENT
        return pb.Empty()

    @_validated
    def report_failure(self, request: pb.ReportFailureRequest, context: Any) -> pb.Empty:
        worker_id = _worker(request.worker_id)
        _text("replica", request.replica, MAX_NAME)
        message = _text("err_message", request.err_message)
        logger.error("worker %d reported: %s", worker_id, short(message, 300))
        self.core.worker_reported(worker_id, message,
                                  _text("err_traceback", request.err_traceback))
        return pb.Empty()

    def _known_task(self, task_id: int) -> None:
        if not self.core.task_exists(task_id):
            raise _Invalid(f"unknown task_id {task_id}")

    def _rdzv(self) -> RendezvousHandler:
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
        if not request.host or len(request.host) > MAX_NAME or not 0 <= request.port < 65536:
            raise _Invalid(f"join needs a host and a port in 0..65535 (0: none), got "
                           f"{request.host!r}:{request.port}")
        try:
            plan = self._rdzv().join(worker_id, request.host, request.port)
        except MemberConflict as e:
            raise _Denied(str(e)) from None
        self.core.snapshot()  # a member (and maybe a plan) a restarted master must know
        return self._plan(plan)

    def _durable(self, plan: Any) -> pb.CommPlan:
        """A plan is in the core's snapshot before any member sees it (a restarted
        master serves the same plan)."""
        if plan.plan_version != self._snapshotted_plan:
            self.core.snapshot()
            self._snapshotted_plan = plan.plan_version
        return self._plan(plan)

    @_validated
    def get_comm_plan(self, request: pb.CommPlanRequest, context: Any) -> pb.CommPlan:
        return self._durable(self._rdzv().get_comm_plan(_worker(request.worker_id),
                                                         request.known_plan_version))

    @_validated
    def report_collective_failure(self, request: pb.CollectiveFailureRequest,
                                  context: Any) -> pb.CommPlan:
        worker_id = _worker(request.worker_id)
        if not 0 <= request.plan_version <= MAX_VERSION:
            raise _Invalid(f"plan_version must be in [0, {MAX_VERSION}]")
        return self._durable(self._rdzv().report_failure(worker_id, request.plan_version,
                                                         _text("reason", request.reason)))

    def echo(self, request: pb.Empty, context: Any) -> pb.Empty:
        return pb.Empty()

    @_validated
    def scale(self, request: pb.ScaleRequest, context: Any) -> pb.JobSize:
        """``elasticdl scale``: new MIN:MAX; the job controller adds or retires
        workers. Journaled (op resize) before the reply."""
        if auth.caller_replica(context) is not None:
            raise _Denied("replicas may not resize the job")
        counts = self._scaling()
        try:
            self.core.resize_workers(request.min_workers, request.max_workers,
                                     _text("reason", request.reason, MAX_NAME)
                                     or "elasticdl scale")
        except ValueError as e:
            raise _Invalid(str(e)) from None
        logger.info("resize to %d:%d requested", request.min_workers, request.max_workers)
        return self._size(counts)

    @_validated
    def get_job_size(self, request: pb.Empty, context: Any) -> pb.JobSize:
        return self._size(self._scaling())

    def _scaling(self) -> Any:
        counts = self.core.attachments.get("scaling")
        if counts is None:
            raise _Invalid("this master runs no worker bookkeeping (a local job)")
        return counts

    @staticmethod
    def _size(counts: Any) -> pb.JobSize:
        w = counts.report()
        return pb.JobSize(min_workers=w["min"], max_workers=w["max"],
                          running_workers=counts.num_training(), pending_workers=w["pending"],
                          retiring_workers=len(w["retiring"]))


def start_master_server(servicer: MasterServicer, port: int, host: str = "[::]",
                        max_workers: int = 8,
                        job_secrets: Optional[auth.JobSecrets] = None) -> grpc.Server:
    """Serve the master on ``host:port``; raises RuntimeError if the port is taken.

    ``max_workers``: handler threads. No master handler waits on anything but the
    core's lock and the journal's fsync, and the handlers share one GIL, so more
    threads only contend: with 1,000 workers at 3,000 tasks/s, 8 threads answer
    get_tasks with p99 ~150 ms where 64 took ~300 ms (benchmarks/master_dispatch.py).

    With ``job_secrets`` every call must carry the job token (TLS when the
    secrets hold a certificate)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="master-rpc"),
                         options=GRPC_OPTIONS,
                         interceptors=auth.server_interceptors(job_secrets))
    add_service(servicer, server, "Master")
    bound = auth.add_port(server, f"{host}:{port}", job_secrets)
    if bound == 0:
        raise RuntimeError(f"master cannot bind port {port}")
    server.start()
    logger.info("master serving on port %d (%s)", bound, auth.describe(job_secrets))
    return server

