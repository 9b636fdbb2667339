"""Reading the next leased task's records while the current one runs (read_ahead.py):
each task still runs on exactly its own records, reads never overlap, and a failed read
ahead fails its own task, not the one running."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from elasticdl.common.task import Task, TaskType
from elasticdl.data.api import DataError
from elasticdl.worker.read_ahead import ReadAhead
from elasticdl.worker.task_loop import TaskLoop
from tests.unit.fakes import eval_module_spec

READ_S = 0.02


class _Trainer:
    device = torch.device("cpu")
    sequence = None

    def __init__(self):
        self.seen: list[int] = []

    def forward(self, features):
        self.seen.extend(int(v) for v in features.reshape(-1).tolist())
        time.sleep(READ_S)                       # the task's work, to overlap
        return features.float() / 100.0


class _Reader:
    """Records = their indexes; slow; records who read and whether reads overlapped."""

    def __init__(self, bad_start: int = -1):
        self.bad_start = bad_start
        self.threads: list[str] = []
        self.active = 0
        self.overlapped = False
        self._lock = threading.Lock()

    def read(self, name, start, end):
        with self._lock:
            self.active += 1
            self.overlapped |= self.active > 1
            self.threads.append(threading.current_thread().name)
        try:
            time.sleep(READ_S)
            if start == self.bad_start:
                raise DataError(f"{name}: malformed record {start}")
            return list(range(start, end))
        finally:
            with self._lock:
                self.active -= 1


class _Leasing:
    """A source that leases evaluation tasks of 10 records (as MasterClient)."""

    def __init__(self, tasks: int):
        self.queue = [Task(i, TaskType.EVALUATION, "v", 10 * i, 10 * i + 10, -1, 3)
                      for i in range(tasks)]
        self.failed: list[tuple[int, str]] = []
        self.evaluated: list[int] = []

    def report_request(self, task, error="", traceback="", fatal=False, counters=None,
                       loss=None, learning_rate=None):
        return (task.task_id, error)

    def get_tasks(self, task_type, max_tasks, reports=()):
        self.failed += [r for r in reports if r[1]]
        if not self.queue:
            return [Task(-1, TaskType.NONE, "", 0, 0)]
        out, self.queue = self.queue[:max_tasks], self.queue[max_tasks:]
        return out

    def report_tasks(self, reports):
        self.failed += [r for r in reports if r[1]]

    def report_evaluation(self, task, metrics_, states=b""):
        self.evaluated.append(task.task_id)


def _spec(tmp_path):
    return eval_module_spec(str(tmp_path), "ra")


def test_leased_tasks_are_read_ahead_each_on_its_own_records_never_two_reads_at_once(
        tmp_path):
    source, trainer, reader = _Leasing(30), _Trainer(), _Reader()
    loop = TaskLoop(source, trainer, _spec(tmp_path),  # type: ignore[arg-type]
                    {TaskType.EVALUATION: reader}, minibatch_size=10, lease_s=1.0)
    loop.run()
    assert source.evaluated == list(range(30)) and source.failed == []
    assert sorted(trainer.seen) == list(range(300))      # each record once, its own task's
    assert not reader.overlapped
    ahead = sum(t.startswith("read-ahead") for t in reader.threads)
    assert len(reader.threads) == 30 and ahead >= 25, reader.threads   # all but lease heads
    assert not any(t.name.startswith("read-ahead") for t in threading.enumerate())


def test_a_failed_read_ahead_fails_its_own_task_when_it_runs(tmp_path):
    source, trainer, reader = _Leasing(12), _Trainer(), _Reader(bad_start=80)
    loop = TaskLoop(source, trainer, _spec(tmp_path),  # type: ignore[arg-type]
                    {TaskType.EVALUATION: reader}, minibatch_size=10, lease_s=1.0)
    with pytest.raises(DataError, match="malformed record 80"):
        loop.run()
    assert source.evaluated == list(range(8))            # tasks 0-7 ran, in full
    assert [t for t, _ in source.failed] == [8]          # task 8 failed, not task 7
    assert not any(t.name.startswith("read-ahead") for t in threading.enumerate())


def test_a_read_ahead_of_a_task_not_run_next_is_waited_for_and_dropped():
    reads: list[int] = []
    gate = threading.Event()

    def read(task):
        gate.wait(5)
        reads.append(task.task_id)
        return task.task_id

    ahead = ReadAhead(read)  # type: ignore[arg-type]
    a, b = Task(1, TaskType.TRAINING, "s", 0, 10), Task(2, TaskType.TRAINING, "s", 10, 20)
    ahead.start(a)
    threading.Timer(0.1, gate.set).start()
    assert ahead.take(b) is None and reads == [1]      # waited for, then dropped
    assert ahead.dropped == 1 and ahead.hits == 0
    ahead.start(b)
    assert ahead.take(b) == 2 and ahead.hits == 1
    ahead.close()
