"""Observability of a job: what its core tells listeners, and the wiring of the
TensorBoard event files (:mod:`tensorboard_events`) and the Prometheus endpoint
(:mod:`prometheus_metrics`) to it.

The :class:`~elasticdl.master.job.JobCore` calls its listeners (``add_listener``)
by method name, under its lock, from gRPC handlers and the control loop; every
listener here only updates a few numbers or queues an event, never blocks, and
never imports torch (the master does not). See docs/observability.md.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Optional

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
METRICS_FILE = "metrics_endpoint.json"   # in the job dir: where the master serves /metrics


class JobListener:
    """What a job core tells its listeners (override what you need).

    ``version``: the job's model version when it happened (never goes back), the
    x axis of every TensorBoard series except evaluations (the evaluated version).
    """

    def on_training_task(self, epoch: int, records: int, loss: Optional[float],
                         learning_rate: Optional[float], version: int) -> None:
        """A training task of ``epoch`` finished: its mean loss over ``records`` and
        the learning rate its last step was applied with (either may be None)."""

    def on_evaluation(self, version: int, metrics: dict[str, float]) -> None:
        """The evaluation of model ``version`` completed with ``metrics``."""

    def on_epoch_end(self, epoch: int, version: int) -> None:
        """Every training task of ``epoch`` is done."""

    def on_relaunch(self, replica: str, new_replica: str, reason: str, version: int) -> None:
        """``replica`` ended (``reason``) and ``new_replica`` replaces it."""

    def on_replica(self, kind: str, index: int, alive: bool) -> None:
        """Replica ``kind`` ("worker", "ps") ``index`` started (or was adopted) or ended."""


class RateMeter:
    """Records per second over a sliding window of ``window_s`` seconds, counted in
    buckets of a thirtieth of the window (an add costs the same at any rate)."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._bucket_s = window_s / 30
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: deque[list[float]] = deque()   # [bucket start, records]
        self._start = clock()

    def _expire(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] < now - self.window_s:
            self._buckets.popleft()

    def add(self, records: int) -> None:
        with self._lock:
            now = self._clock()
            last = self._buckets[-1] if self._buckets else None
            if last is not None and now - last[0] < self._bucket_s:
                last[1] += records
            else:
                self._buckets.append([now, records])
                self._expire(now)

    def rate(self) -> float:
        """Records per second over the window (over the time since the meter
        started while that is shorter than the window)."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            span = min(self.window_s, now - self._start)
            total = sum(r for _, r in self._buckets)
            return total / span if span > 0 else 0.0


class LiveFigures(JobListener):
    """The latest training figures (for the Prometheus endpoint): the last
    training task's loss and learning rate, records per second, epoch."""

    def __init__(self, window_s: float = 30.0):
        self.loss: Optional[float] = None
        self.learning_rate: Optional[float] = None
        self.epoch: Optional[int] = None
        self.meter = RateMeter(window_s)

    def on_training_task(self, epoch: int, records: int, loss: Optional[float],
                         learning_rate: Optional[float], version: int) -> None:
        self.meter.add(records)
        self.epoch = epoch
        if loss is not None:
            self.loss = float(loss)
        if learning_rate is not None:
            self.learning_rate = float(learning_rate)


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
