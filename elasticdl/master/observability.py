"""Observability of a job: the wiring of the TensorBoard event files
(:mod:`tensorboard_events`) and the Prometheus endpoint (:mod:`prometheus_metrics`)
to its core, as listeners (:class:`~elasticdl.master.listeners.JobListener`, what
the core tells them; :mod:`live_figures`, the latest training figures).

The :class:`~elasticdl.master.job.JobCore` calls its listeners (``add_listener``)
by method name, under its lock, from gRPC handlers and the control loop; every
listener here only updates a few numbers or queues an event, never blocks, and
never imports torch (the master does not). See docs/observability.md.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from elasticdl.master.listeners import JobListener  # noqa: F401 - re-exported
from elasticdl.master.live_figures import LiveFigures

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
METRICS_FILE = "metrics_endpoint.json"   # in the job dir: where the master serves /metrics


class Observability:
    """The TensorBoard writer and the metrics endpoint of one job core; ``close``
    flushes and stops both (idempotent)."""

    def __init__(self) -> None:
        self.writer: Any = None       # tensorboard_events.ScalarEventWriter
        self.server: Any = None       # prometheus_metrics.MetricsServer
        self.figures = LiveFigures()

    @property
    def address(self) -> str:
        return self.server.address if self.server is not None else ""

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def stop_endpoint(self) -> None:
        """Stop serving /metrics (first thing when a master ends: its successor
        may be waiting for the port)."""
        if self.server is not None:
            self.server.stop()
            self.server = None

    def close(self) -> None:
        self.stop_endpoint()
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def publish(obs: Observability, job_dir: str, report: Any) -> None:
    """Tell the CLI where /metrics is: ``<job_dir>/metrics_endpoint.json`` and the
    report's ``metrics_endpoint``."""
    if not obs.address:
        return
    report.extra["metrics_endpoint"] = obs.address
    path = os.path.join(job_dir, METRICS_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump({"address": obs.address, "pid": os.getpid(), "started": time.time()}, f)
    os.replace(path + ".tmp", path)


class ObservabilityError(RuntimeError):
    """The event files cannot be written or the metrics port cannot be served."""


def _remove_old_runs(logdir: str) -> None:
    """A fresh job on the same --output starts a new series: the event files an
    earlier job wrote there (ours: suffix ``.elasticdl``) are removed."""
    old = [n for n in os.listdir(logdir) if n.startswith("events.out.tfevents.")
           and n.endswith(".elasticdl")] if os.path.isdir(logdir) else []
    for name in old:
        os.unlink(os.path.join(logdir, name))
    if old:
        logger.info("removed %d TensorBoard event file(s) of an earlier job in %s", len(old),
                    logdir)


def attach(core: Any, output: str = "", metrics_port: int = -1, host: str = "127.0.0.1",
           advertise: str = "", track_ps: bool = False, fresh: bool = True,
           flush_secs: float = 5.0) -> Observability:
    """Hook TensorBoard (``<output>/tensorboard``, when ``output``) and the Prometheus
    endpoint (``metrics_port`` >= 0, 0 picks a free port, bound to ``host`` and
    shown as ``advertise``:port) to ``core``. ``track_ps``: count live PS from the
    job controller's notes (a master with a cluster). ``fresh``: a new job (not a
    restored master): earlier jobs' event files in that directory are removed; a
    restored master retries a metrics port in use for ``BIND_WAIT_S`` (its
    predecessor may still be closing). Raises :class:`ObservabilityError` naming
    the flag when either cannot start."""
    obs = Observability()
    core.add_listener(obs.figures)
    if output:
        from elasticdl.master.tensorboard_events import ScalarEventWriter, TensorBoardListener

        logdir = os.path.join(output, TENSORBOARD_DIR)
        try:
            if fresh:
                _remove_old_runs(logdir)
            obs.writer = ScalarEventWriter(logdir, flush_secs=flush_secs)
        except OSError as e:
            raise ObservabilityError(f"--output: cannot write TensorBoard event files in "
                                     f"{logdir}: {e}") from e
        core.add_listener(TensorBoardListener(obs.writer, core))
        logger.info("TensorBoard event files in %s", obs.writer.logdir)
    if metrics_port >= 0:
        from elasticdl.master.prometheus_metrics import BIND_WAIT_S, MetricsServer, ReplicaCounts

        replicas = ReplicaCounts() if track_ps else None
        if replicas is not None:
            core.add_listener(replicas)
        try:
            # a restored master may race its terminating predecessor for the port
            obs.server = MetricsServer.start(core, obs.figures, host, metrics_port, replicas,
                                             advertise, bind_wait_s=0.0 if fresh else BIND_WAIT_S)
        except OSError as e:
            obs.close()
            raise ObservabilityError(f"--metrics_port: cannot serve metrics on "
                                     f"{host}:{metrics_port}: {e}") from e
        logger.info("Prometheus metrics at http://%s/metrics", obs.server.address)
    return obs
