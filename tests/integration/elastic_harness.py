"""In-process stand-ins of the master for elastic allreduce tests.

The test process owns a real :class:`Rendezvous` and :class:`TaskManager` and
serves them to worker processes over a ``multiprocessing`` manager on
127.0.0.1; :class:`FakeComm` and :class:`FakeSource` are what the workers'
``AllreduceTrainer`` talks to instead of the gRPC master client.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from multiprocessing.managers import BaseManager
from typing import Any, Optional

from elasticdl.common.task import Task, TaskType
from elasticdl.master.task_manager import TaskManager
from elasticdl.worker.task_source import Metric, TaskSource

AUTHKEY = b"elasticdl-test"
_SHARED: dict[str, Any] = {}


class _Manager(BaseManager):
    pass


_Manager.register("rdzv", callable=lambda: _SHARED["rdzv"])
_Manager.register("tm", callable=lambda: _SHARED["tm"])
_Manager.register("agg", callable=lambda: _SHARED["agg"])


class MasterStandIn:
    """Serves ``rdzv``, ``tm`` and ``agg`` to other processes until :meth:`close`."""

    def __init__(self, rdzv: Any, tm: Optional[TaskManager] = None, agg: Any = None):
        _SHARED["rdzv"] = rdzv
        _SHARED["tm"] = tm
        _SHARED["agg"] = agg
        self._server = _Manager(address=("127.0.0.1", 0), authkey=AUTHKEY).get_server()
        self.address = self._server.address
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self._server.serve_forever()
        except SystemExit:  # serve_forever exits its thread with sys.exit
            pass

    def close(self) -> None:
        stop = getattr(self._server, "stop_event", None)
        if stop is not None:
            stop.set()
        self._thread.join(5)


def connect(address: Any) -> _Manager:
    mgr = _Manager(address=address, authkey=AUTHKEY)
    mgr.connect()
    return mgr


class FakeComm:
    """The master's rendezvous as ``AllreduceTrainer`` expects it (a CommClient)."""

    def __init__(self, rdzv: Any, worker_id: int):
        self.rdzv = rdzv
        self.worker_id = worker_id

    def join(self, host: str, port: int) -> Any:
        return self.rdzv.join(self.worker_id, host, port)

    def get_comm_plan(self, known_version: int) -> Any:
        return self.rdzv.get_comm_plan(self.worker_id, known_version)

    def report_collective_failure(self, plan_version: int, reason: str) -> Any:
        return self.rdzv.report_failure(self.worker_id, plan_version, reason)


class FakeSource(TaskSource):
    def __init__(self, tm: Any, worker_id: int, agg: Any = None):
        self.tm = tm
        self.worker_id = worker_id
        self.agg = agg

    def get_task(self, task_type: Optional[TaskType] = None) -> Task:
        return self.tm.get(self.worker_id, task_type)

    def report_task(self, task: Task, error: str = "", traceback: str = "",
                    fatal: bool = False, counters: Any = None, loss: Optional[float] = None,
                    learning_rate: Optional[float] = None) -> None:
        self.tm.report(task.task_id, self.worker_id, not error, error, traceback, fatal,
                       counters=counters)

    def report_evaluation(self, task: Task, metrics: Sequence[Metric],
                          states: bytes = b"") -> None:
        if self.agg is not None:
            self.agg.add(task.model_version, task.task_id, list(metrics), states)


class MemoryReader:
    """Records of the toy linear model, generated from their index."""

    def __init__(self, n: int):
        import numpy as np

        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(n, 4)).astype(np.float32)
        w = np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32)
        self.y = (self.x @ w + 0.1).astype(np.float32)

    def read(self, name: str, start: int, end: int) -> list[dict]:
        return [{"x": self.x[i], "y": float(self.y[i]), "id": i} for i in range(start, end)]
