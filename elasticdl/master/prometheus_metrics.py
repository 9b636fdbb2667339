"""The master's Prometheus endpoint: ``GET /metrics`` in the text format, from
its own registry (``prometheus_client``), served by a daemon thread.

The figures are read from the job core when scraped (:class:`JobCollector`),
so they are never stale and nothing is done per task. Names, types and labels
are listed in docs/observability.md and :data:`METRICS`.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, Optional

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from elasticdl.common.task import TaskType
from elasticdl.master.listeners import JobListener
from elasticdl.master.live_figures import LiveFigures

logger = logging.getLogger(__name__)

BIND_WAIT_S = 30.0  # how long a restored master retries a metrics port in use

# family name -> (type, labels); a counter's sample is <name>_total
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "elasticdl_job_info": ("gauge", ("job_name", "strategy", "cluster", "job_type", "status")),
    "elasticdl_model_version": ("gauge", ()),
    "elasticdl_epochs": ("gauge", ()),
    "elasticdl_epochs_completed": ("gauge", ()),
    "elasticdl_epoch_records": ("gauge", ()),
    "elasticdl_epoch_records_completed": ("gauge", ("epoch",)),
    "elasticdl_epoch_records_redone": ("gauge", ("epoch",)),
    "elasticdl_tasks": ("gauge", ("type", "state")),
    "elasticdl_workers_alive": ("gauge", ()),
    "elasticdl_workers_requested": ("gauge", ()),
    "elasticdl_workers_pending": ("gauge", ()),
    "elasticdl_workers_pending_reason": ("gauge", ("reason",)),
    "elasticdl_workers_min": ("gauge", ()),
    "elasticdl_workers_preempted": ("counter", ()),
    "elasticdl_workers_under_min_seconds": ("counter", ()),
    "elasticdl_workers_resizes": ("counter", ()),
    "elasticdl_ps_alive": ("gauge", ()),
    "elasticdl_ps_requested": ("gauge", ()),
    "elasticdl_relaunches": ("counter", ("replica_type", "reason")),
    "elasticdl_master_restarts": ("counter", ()),
    "elasticdl_evaluations": ("counter", ()),
    "elasticdl_evaluation_model_version": ("gauge", ()),
    "elasticdl_evaluation_metric": ("gauge", ("metric",)),
    "elasticdl_training_loss": ("gauge", ()),
    "elasticdl_learning_rate": ("gauge", ()),
    "elasticdl_training_records_per_second": ("gauge", ()),
}


class ReplicaCounts(JobListener):
    """Which PS are alive, from the job controller's ``on_replica`` notes (the
    replica book keeps the workers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ps: set[int] = set()

    def on_replica(self, kind: str, index: int, alive: bool) -> None:
        if kind != "ps":
            return
        with self._lock:
            (self._ps.add if alive else self._ps.discard)(index)

    def ps_alive(self) -> int:
        with self._lock:
            return len(self._ps)


def task_counts(tm: Any) -> dict[tuple[str, str], int]:
    """``(type, state) -> tasks`` of a task manager: todo, doing, done by type
    (a read-only look at its tables, as :mod:`task_state` takes)."""
    names = {TaskType.TRAINING: "training", TaskType.EVALUATION: "evaluation",
             TaskType.PREDICTION: "prediction"}
    out = {(n, s): 0 for n in names.values() for s in ("todo", "doing", "done")}
    with tm._lock:
        for typ, n in tm.queued().items():
            if typ in names:
                out[(names[typ], "todo")] += n
        for doing in tm._doing.values():
            if doing.task.type in names:
                out[(names[doing.task.type], "doing")] += 1
        out[("training", "done")] = sum(led.tasks_completed for led in tm.ledger.values())
        out[("prediction", "done")] = tm.prediction_ledger.tasks_completed
        out[("evaluation", "done")] = tm.evaluation_tasks_completed
        # training tasks of epochs not created yet are still to do
        future = max(tm.num_epochs - tm._epochs_created, 0)
        out[("training", "todo")] += future * len(tm._train_pieces)
    return out


def _gauge(name: str, doc: str, value: Optional[float] = None,
           labels: Optional[dict[str, str]] = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(METRICS[name][1]))
    if value is not None:
        family.add_metric([(labels or {})[k] for k in METRICS[name][1]], float(value))
    return family


class JobCollector(Collector):
    """The job's figures, read from the core at each scrape."""

    def __init__(self, core: Any, figures: LiveFigures,
                 replicas: Optional[ReplicaCounts] = None):
        self.core = core
        self.figures = figures
        self.replicas = replicas

    def collect(self) -> Iterator[Any]:
        core, tm, report = self.core, self.core.tm, self.core.report
        with core._lock:
            epochs = tm.epochs_report()
            version = core.version
            evaluations = [dict(e) for e in report.evaluations]
            relaunches = [dict(r) for r in report.relaunches]
            restarts = len(report.extra.get("master_restarts", []))
            status = report.status
        yield _gauge("elasticdl_job_info", "The job (value 1)", 1,
                     {"job_name": report.job_name, "strategy": str(report.strategy),
                      "cluster": str(report.cluster), "job_type": str(report.job_type),
                      "status": status})
        yield _gauge("elasticdl_model_version", "The job's model version", version)
        yield _gauge("elasticdl_epochs", "Training epochs of the job (--num_epochs)",
                     tm.num_epochs)
        yield _gauge("elasticdl_epochs_completed", "Epochs whose every training task is done",
                     sum(1 for e in epochs if tm.training_records and
                         e["records_completed"] >= tm.training_records))
        yield _gauge("elasticdl_epoch_records", "Training records per epoch (dataset size)",
                     tm.training_records)
        done = _gauge("elasticdl_epoch_records_completed",
                      "Records in completed training tasks, per epoch")
        redone = _gauge("elasticdl_epoch_records_redone",
                        "Records trained again after failures, per epoch")
        for e in epochs:
            done.add_metric([str(e["epoch"])], e["records_completed"])
            redone.add_metric([str(e["epoch"])], e["records_redone"])
        yield done
        yield redone
        tasks = _gauge("elasticdl_tasks", "Tasks by type and state (todo, doing, done)")
        for (typ, state), n in sorted(task_counts(tm).items()):
            tasks.add_metric([typ, state], n)
        yield tasks
        yield from self._workers(core, report)
        if self.replicas is not None:
            yield _gauge("elasticdl_ps_alive", "Parameter servers running",
                         self.replicas.ps_alive())
        yield _gauge("elasticdl_ps_requested", "Parameter servers of the job", report.num_ps)
        yield from self._counters(relaunches, restarts, len(evaluations))
        yield from self._evaluation(evaluations)
        yield from self._training()

    def _workers(self, core: Any, report: Any) -> Iterator[Any]:
        """Running (not pending) workers, pending ones by the scheduler's reason,
        the bounds (docs/elastic.md); without elastic bookkeeping, the live ones."""
        counts = core.attachments.get("scaling")
        if counts is None:  # no job controller (in-process jobs): the live ones
            from elasticdl.master.scaling import WorkerCounts

            counts = WorkerCounts(report.num_workers, report.num_workers)
            counts.running = set(core.replicas.live_workers)
        w = counts.report()
        yield _gauge("elasticdl_workers_alive", "Workers running (pending ones not counted)",
                     w["running"])
        yield _gauge("elasticdl_workers_requested", "Workers asked for (MAX of "
                     "--num_workers=MIN:MAX, or elasticdl scale)", w["max"])
        yield _gauge("elasticdl_workers_min", "Workers the job needs to train (MIN)", w["min"])
        yield _gauge("elasticdl_workers_pending", "Workers created but not running",
                     w["pending"])
        reasons = _gauge("elasticdl_workers_pending_reason",
                         "Pending workers, by the scheduler's reason")
        for reason, n in sorted(counts.pending_reason_counts().items()):
            reasons.add_metric([reason[:200]], n)
        yield reasons
        for name, help, value in (
                ("elasticdl_workers_preempted", "Workers preempted", w["preempted"]),
                ("elasticdl_workers_under_min_seconds", "Seconds with fewer than MIN "
                 "workers running", w["time_under_min_s"]),
                ("elasticdl_workers_resizes", "Resizes (elasticdl scale)", w["resizes_total"])):
            family = CounterMetricFamily(name, help)
            family.add_metric([], value)
            yield family

    def _counters(self, relaunches: list[dict[str, Any]], restarts: int,
                  evaluations: int) -> Iterator[Any]:
        by: dict[tuple[str, str], int] = {}
        for r in relaunches:
            key = (str(r["replica"]).rsplit("-", 1)[0], str(r["reason"]))
            by[key] = by.get(key, 0) + 1
        family = CounterMetricFamily("elasticdl_relaunches", "Replicas relaunched, by "
                                     "replica type and reason",
                                     labels=["replica_type", "reason"])
        for (typ, reason), n in sorted(by.items()):
            family.add_metric([typ, reason], n)
        yield family
        yield CounterMetricFamily("elasticdl_master_restarts", "Master restarts (failover)",
                                  value=restarts)
        yield CounterMetricFamily("elasticdl_evaluations", "Evaluations completed",
                                  value=evaluations)

    def _evaluation(self, evaluations: list[dict[str, Any]]) -> Iterator[Any]:
        last = evaluations[-1] if evaluations else None
        yield _gauge("elasticdl_evaluation_model_version", "Model version of the last "
                     "evaluation", None if last is None else last["model_version"])
        family = _gauge("elasticdl_evaluation_metric", "Metrics of the last evaluation")
        for name, value in sorted((last or {}).get("metrics", {}).items()):
            family.add_metric([name], float(value))
        yield family

    def _training(self) -> Iterator[Any]:
        f = self.figures
        yield _gauge("elasticdl_training_loss", "Mean loss of the last training task",
                     f.loss)
        yield _gauge("elasticdl_learning_rate", "Learning rate of the last training step "
                     "reported", f.learning_rate)
        yield _gauge("elasticdl_training_records_per_second", "Training records per "
                     f"second over the last {f.meter.window_s:.0f} s", f.meter.rate())


class MetricsServer:
    """``/metrics`` of one job core on ``host:port``."""

    def __init__(self, server: Any, thread: threading.Thread, host: str):
        self._server = server
        self._thread = thread
        self.port = int(server.server_port)
        self.address = f"{host}:{self.port}"

    @classmethod
    def start(cls, core: Any, figures: LiveFigures, host: str, port: int,
              replicas: Optional[ReplicaCounts] = None, advertise: str = "",
              bind_wait_s: float = 0.0) -> MetricsServer:
        """Serve on ``port`` (0: a free one) of ``host`` ("0.0.0.0": every interface);
        ``address`` is ``advertise`` (default ``host``) and the port. A port in use
        is retried for ``bind_wait_s``: a replacement master pod can start while its
        terminating predecessor still holds the port (pods sharing the host's
        network); past that the ``OSError`` is raised."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(JobCollector(core, figures, replicas))
        deadline = time.monotonic() + bind_wait_s
        warned = False
        while True:
            try:
                server, thread = start_http_server(port, addr=host, registry=registry)
                return cls(server, thread, advertise or host)
            except OSError as e:
                if e.errno != errno.EADDRINUSE or port == 0 or time.monotonic() >= deadline:
                    raise
                if not warned:
                    logger.warning("metrics port %s:%d in use (the master this one replaces "
                                   "still closing?): retrying for up to %.0f s", host, port,
                                   bind_wait_s)
                    warned = True
                time.sleep(0.5)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout_s)
