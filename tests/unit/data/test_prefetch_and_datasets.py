"""Minibatches made ahead in a thread; a module's torch Dataset read by task index ranges
through a DataLoader; the Arrow / Hugging Face ``save_to_disk`` reader; the master's
torch-free view of a module's dataset."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from elasticdl.common.task import Task, TaskType
from elasticdl.data.api import DataError, MalformedRecordError
from elasticdl.data.dataset_source import module_defines
from elasticdl.data.prefetch import Prefetcher
from elasticdl.data.torch_dataset import TorchDatasetReader
from elasticdl.worker.minibatches import FeedError, TaskRecords
from tests.conftest import FIXTURE_ZOO, ROOT


# ---------------------------------------------------------------------- Prefetcher
def test_prefetcher_yields_in_order_and_runs_ahead_at_most_depth():
    made = []

    def items():
        for i in range(6):
            made.append(i)
            yield i

    p = Prefetcher(items(), depth=2)
    first = next(p)
    # item 0 taken, 2 more queued, and one more made and waiting to be put: 4 made, and
    # not one more however long it waits (waited for, not slept on: a loaded machine
    # may take long to run the producer at all)
    deadline = time.monotonic() + 30
    while len(made) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert first == 0 and len(made) == 4
    assert [first, *p] == list(range(6))


def test_prefetcher_raises_the_producers_error_at_its_item():
    def items():
        yield 1
        yield 2
        raise MalformedRecordError("/data/f.csv", 7, "bad field")

    p = Prefetcher(items(), depth=2)
    assert next(p) == 1 and next(p) == 2
    with pytest.raises(MalformedRecordError, match=r"/data/f.csv: malformed record 7"):
        next(p)
    with pytest.raises(StopIteration):
        next(p)


def test_closing_a_prefetcher_stops_a_blocked_producer():
    released = threading.Event()

    def items():
        try:
            yield from range(1000)
        finally:
            released.set()

    p = Prefetcher(items(), depth=1)
    assert next(p) == 0
    p.close()
    assert released.wait(5), "the producer thread did not stop"
    with pytest.raises(StopIteration):
        next(p)


# ---------------------------------------------------------------------- torch datasets
class Squares(Dataset):
    def __init__(self, n: int, bad: int = -1):
        self.n, self.bad, self.loaded = n, bad, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded.append(i)
        if i == self.bad:
            raise KeyError(f"no sample {i}")
        return torch.tensor([float(i)]), i * i


def _pair(batch, mode):
    return batch[0], batch[1]


def _task(start, end, typ=TaskType.TRAINING, shard="ds"):
    return Task(3, typ, shard, start, end)


def test_task_minibatches_are_its_index_ranges_and_skipped_ones_are_never_loaded():
    ds = Squares(50)
    reader = TorchDatasetReader("ds", ds)
    records = TaskRecords(reader, _task(10, 30), "training", 8, _pair)
    assert records.num_minibatches == 3   # 8, 8, 4
    with records.produce(skip={1}) as batches:
        got = [(mb.index, mb.start, mb.stop, mb.labels.tolist()) for mb in batches]
    assert got == [(0, 0, 8, [i * i for i in range(10, 18)]),
                   (2, 16, 20, [i * i for i in range(26, 30)])]
    assert sorted(ds.loaded) == list(range(10, 18)) + list(range(26, 30))
    # minibatch k is the same records when made again (a retry, another worker)
    again = records.make(2)
    assert again.labels.tolist() == [i * i for i in range(26, 30)]


def test_dataloader_worker_processes_load_the_same_minibatches():
    reader = TorchDatasetReader("ds", Squares(40), num_workers=2)
    records = TaskRecords(reader, _task(0, 40), "training", 16, _pair)
    for _ in range(2):   # persistent workers, reused by the next task
        with records.produce() as batches:
            assert [mb.labels.tolist() for mb in batches] == \
                [[i * i for i in range(a, min(a + 16, 40))] for a in (0, 16, 32)]


def test_a_failing_item_is_named_by_its_index():
    reader = TorchDatasetReader("/data/ds", Squares(40, bad=21), num_workers=1)
    records = TaskRecords(reader, _task(16, 32, shard="/data/ds"), "training", 4, _pair)
    with records.produce() as batches:
        assert next(batches).labels.tolist() == [256, 289, 324, 361]
        with pytest.raises(MalformedRecordError, match=r"/data/ds: malformed record 21: "
                                                       r"dataset\[21\] raised KeyError"):
            next(batches)


def test_collate_and_feed_errors_name_the_records():
    def collate(items):
        if any(y == 49 for _, y in items):
            raise ValueError("cannot collate 49")
        return torch.utils.data.default_collate(items)

    reader = TorchDatasetReader("ds", Squares(20), collate_fn=collate)
    with pytest.raises(MalformedRecordError, match=r"record 7: collate rejected it"):
        list(TaskRecords(reader, _task(0, 20), "training", 4, _pair).produce())

    def bad_feed(batch, mode):
        raise RuntimeError("feed broke")

    reader = TorchDatasetReader("ds", Squares(20))
    with pytest.raises(FeedError, match=r"feed failed on the collated records 4-8 of ds"):
        list(TaskRecords(reader, _task(4, 12), "training", 4, bad_feed).produce())


def test_iterable_datasets_and_bad_ranges_are_refused():
    class Stream(IterableDataset):
        def __iter__(self):
            yield 1

    with pytest.raises(DataError, match="IterableDataset"):
        TorchDatasetReader("ds", Stream())
    with pytest.raises(DataError, match="not a map-style dataset"):
        TorchDatasetReader("ds", object())
    reader = TorchDatasetReader("ds", Squares(10))
    with pytest.raises(ValueError, match=r"invalid record range \[8, 12\).* of 10 records"):
        TaskRecords(reader, _task(8, 12), "training", 4, _pair)


# ---------------------------------------------------------------------- model calls
def test_features_are_spread_into_forward_only_when_its_signature_takes_them():
    from elasticdl.worker.trainer import call_model

    class Kw(torch.nn.Module):
        def forward(self, input_ids=None, labels=None, **kwargs):
            return ("kw", input_ids, labels)

    class Two(torch.nn.Module):
        def forward(self, x, hidden):
            return ("two", x, hidden)

    class Whole(torch.nn.Module):   # DeepFM-style: unpacks the tuple itself
        def forward(self, features):
            return ("whole", features)

    assert call_model(Kw(), {"input_ids": 1, "labels": 2}) == ("kw", 1, 2)
    assert call_model(Two(), (1, 2)) == ("two", 1, 2)
    assert call_model(Whole(), (1, 2)) == ("whole", (1, 2))
    assert call_model(Whole(), {"a": 1, "b": 2}) == ("whole", {"a": 1, "b": 2})


# ---------------------------------------------------------------------- Arrow / HF
def test_a_datasets_save_to_disk_directory_is_read_in_order(tmp_path):
    datasets = pytest.importorskip("datasets")
    from elasticdl.data import create_data_reader

    d = datasets.Dataset.from_dict({"input_ids": [[i, i + 1] for i in range(10)],
                                    "n": list(range(10))})
    d.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    reader = create_data_reader(str(tmp_path / "ds"))
    rows = [r for s in reader.create_shards() for r in reader.read(s.name, s.start, s.count)]
    assert [r["n"] for r in rows] == list(range(10)) and rows[3]["input_ids"] == [3, 4]
    first = reader.create_shards()[0]
    assert reader.read(first.name, 1, 3) == [{"input_ids": [1, 2], "n": 1},
                                            {"input_ids": [2, 3], "n": 2}]
    datasets.DatasetDict({"train": d, "test": d}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"DatasetDict \(splits \['train', 'test'\]\); name one"):
        create_data_reader(str(tmp_path / "dd"))
    assert create_data_reader(str(tmp_path / "dd" / "test")).num_records() == 10


# ---------------------------------------------------------------------- the master's view
def test_the_module_source_tells_whether_it_defines_dataset(tmp_path):
    (tmp_path / "a.py").write_text("import torch\ndef dataset(path, mode):\n    pass\n")
    (tmp_path / "b.py").write_text("from lib import dataset\n")
    (tmp_path / "c.py").write_text("def feed(records, mode):\n    dataset = 1\n")
    assert module_defines(str(tmp_path), "a") and module_defines(str(tmp_path), "b")
    assert not module_defines(str(tmp_path), "c")
    assert not module_defines(str(tmp_path), "missing")


MASTER_SCRIPT = r'''
import sys
import numpy as np
from elasticdl.common.job_spec import job_spec_from_flags
import elasticdl.master.main as m
d = sys.argv[1]
np.save(f"{d}/ids.npy", np.arange(77, dtype=np.int64))
spec = job_spec_from_flags("train", {"model_zoo": sys.argv[2],
    "model_def": "toy.count_dataset.custom_model", "training_data": f"{d}/ids.npy",
    "validation_data": f"{d}/ids.npy", "num_workers": 2,
    "distribution_strategy": "ParameterServerStrategy"})
core = m.build_core(spec)
assert core.tm.training_records == 77 and core.tm.evaluation_records == 77
sys.exit(1 if any(n.split(".")[0] == "torch" for n in sys.modules) else 0)
'''


def test_the_master_sizes_a_module_dataset_without_importing_torch(tmp_path):
    r = subprocess.run([sys.executable, "-c", MASTER_SCRIPT, str(tmp_path), FIXTURE_ZOO],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_failing_dataset_is_reported_by_the_probe_with_its_error(tmp_path):
    from elasticdl.api import dataset_probe
    from elasticdl.common.job_spec import job_spec_from_flags
    from elasticdl.data.dataset_source import probe_sizes

    (tmp_path / "broken_ds.py").write_text(
        "import torch\n"
        "def custom_model(): return torch.nn.Linear(1, 1)\n"
        "def loss(labels, outputs): return outputs.sum()\n"
        "def optimizer(params): return torch.optim.SGD(params, lr=0.1)\n"
        "def dataset(path, mode): raise FileNotFoundError(path + ' is gone')\n")
    spec = job_spec_from_flags("train", {"model_zoo": str(tmp_path),
                                         "model_def": "broken_ds.custom_model",
                                         "training_data": "/nowhere/data"})
    with pytest.raises(DataError, match=r"dataset\('/nowhere/data', 'training'\) of .*"
                                        r"broken_ds.py failed: FileNotFoundError"):
        probe_sizes(spec, dataset_probe.command(), timeout_s=240)




# ---------------------------------------------------------------------- contract and allreduce
def test_feed_is_optional_with_a_dataset_and_required_without(tmp_path):
    from elasticdl.api.model_spec import ModelSpecError, load_model_spec

    base = ("import torch\n"
            "def custom_model(): return torch.nn.Linear(1, 1)\n"
            "def loss(labels, outputs): return outputs.sum()\n"
            "def optimizer(params): return torch.optim.SGD(params, lr=0.1)\n")
    (tmp_path / "with_ds.py").write_text(base + "def dataset(path, mode): return [1, 2]\n")
    (tmp_path / "no_feed.py").write_text(base)
    spec = load_model_spec(str(tmp_path), "with_ds.custom_model")
    assert spec.feed is None and spec.dataset is not None
    x = torch.ones(2, 1)
    assert spec.feed_batch((x, torch.zeros(2)), "training")[0] is x
    features, labels = spec.feed_batch({"input_ids": x, "labels": x}, "training")
    assert set(features) == {"input_ids", "labels"} and labels is x
    with pytest.raises(ModelSpecError, match="defines no feed"):
        spec.feed_batch(x, "training")
    with pytest.raises(ModelSpecError, match="defines no feed function 'feed'"):
        load_model_spec(str(tmp_path), "no_feed.custom_model")


def test_allreduce_dataset_makes_ahead_and_remakes_lost_minibatches():
    from elasticdl.local.task_source import LocalTaskSource
    from elasticdl.master.evaluation import EvaluationAggregator
    from elasticdl.master.task_manager import TaskManager
    from elasticdl.worker.elastic_dataset import ElasticDataset
    from tests.unit.elastic.test_elastic_dataset import ScriptedRunner

    ds = Squares(48)
    reader = TorchDatasetReader("s", ds, num_workers=0)
    tm = TaskManager(training_shards=[("s", 0, 48)], records_per_task=48, num_epochs=1)
    source = LocalTaskSource(tm, EvaluationAggregator())
    runner = ScriptedRunner()
    elastic = ElasticDataset(runner, source,  # type: ignore[arg-type]
                             lambda task: TaskRecords(reader, task, "training", 16, _pair),
                             lambda *a: None, 16, wait_s=0.0, max_wait_s=10.0)
    seen: list[int] = []
    lost = False
    for i, (x, _y) in enumerate(elastic):
        tag = elastic.take_current()
        runner.submit(lambda x=x: seen.extend(int(v) for v in x), (), tag.records, tag)
        if i == 1 and not lost:
            lost = True
            runner.lose_unconfirmed()   # minibatch 1 must be made again
    assert seen == list(range(16)) + list(range(16, 32)) * 2 + list(range(32, 48))
    assert tm.finished() and tm.epochs_report()[0]["records_completed"] == 48


class DiesInAWorker(Squares):
    """Record ``kill_at`` kills the DataLoader worker process that loads it (as a signal
    or the OOM killer would); loaded in the trainer's own process, it is fine (which
    batch the reader then reloads one by one depends on how far the loader had
    prefetched, so every record must load in-process)."""

    def __init__(self, n: int, kill_at: int):
        super().__init__(n)
        self.kill_at = kill_at

    def __getitem__(self, i):
        import signal

        from torch.utils.data import get_worker_info

        if i == self.kill_at and get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


def test_a_dead_loader_process_is_a_retryable_error_not_bad_data():
    from elasticdl.data.api import DataError

    reader = TorchDatasetReader("/data/ds", DiesInAWorker(16, kill_at=9), num_workers=1)
    records = TaskRecords(reader, _task(0, 16, shard="/data/ds"), "training", 4, _pair)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="a DataLoader worker process died loading "
                                           "records") as caught:
        with records.produce() as batches:
            list(batches)
    assert not isinstance(caught.value, DataError)  # the task is retried, the job goes on
    # learnt at a poll (5 s), not at the whole --data_loader_timeout_s (120 s): a
    # forkserver's child is not this process's, no SIGCHLD tells the DataLoader
    assert time.monotonic() - started < 60


OWNER_EXITS = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from elasticdl.data.torch_dataset import TorchDatasetReader
from tests.unit.data.loader_datasets import LoaderPids

reader = TorchDatasetReader("ds", LoaderPids(64), num_workers=2, timeout_s=60)
pids = set()
for pid, _ in reader.batches([(0, 8), (8, 16), (16, 24), (24, 32)]):
    pids.update(pid.flatten().tolist())
with open(f"/proc/{min(pids)}/stat") as f:
    server = int(f.read().rsplit(")", 1)[1].split()[1])
print(" ".join(map(str, sorted(pids))), server, flush=True)
os._exit(0)   # as a killed worker: the DataLoader is never shut down
"""


def test_loader_processes_and_their_forkserver_end_with_the_worker(tmp_path):
    """A worker that ends without shutting its DataLoader down (killed; ``os._exit``)
    leaves no process behind: its loader processes (children of the forkserver, whose
    own watchdog watches the server) exit within seconds, and the forkserver with them."""
    log = tmp_path / "out.txt"
    with open(log, "w") as f:   # a file: a pipe would be held open by what is left behind
        rc = subprocess.run([sys.executable, "-c", OWNER_EXITS, ROOT], stdout=f,
                            stderr=subprocess.STDOUT, timeout=120).returncode
    assert rc == 0, log.read_text()[-3000:]
    *loaders, server = (int(p) for p in log.read_text().split()[-3:])
    assert len(set(loaders)) == 2 and server not in loaders

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while any(alive(p) for p in (*loaders, server)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in (*loaders, server) if alive(p)]
    for p in left:   # never leave them behind, even when the test fails
        os.kill(p, 9)
    assert not left, f"still running after the worker exited: {left} (server {server})"


# ------------------------------------------- loader processes and stuck loaders (#32)
def _consume_within(records: TaskRecords, limit_s: float) -> list[list[int]]:
    """The labels of every minibatch of ``records``, or a failure (not a hang) when
    they do not all come within ``limit_s``."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            with records.produce() as batches:
                out["labels"] = [mb.labels.tolist() for mb in batches]
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"the DataLoader hung (no result within {limit_s:.0f} s)"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["labels"]  # type: ignore[return-value]


def test_loader_processes_do_not_inherit_a_lock_another_thread_holds():
    """A thread of the worker (gRPC's, the prefetch thread) holds a lock while the
    DataLoader starts its processes. Forked, each process inherits the lock held and
    blocks on its first item forever (the hang of issue 32). Loader processes start
    from a forkserver instead: the lock is theirs, free."""
    from tests.unit.data.loader_datasets import LOCK, LockedSquares

    reader = TorchDatasetReader("ds", LockedSquares(40), num_workers=2, timeout_s=60)
    released = threading.Event()
    taken = threading.Event()

    def hold() -> None:
        with LOCK:
            taken.set()
            released.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert taken.wait(10)
    try:
        records = TaskRecords(reader, _task(0, 40), "training", 16, _pair)
        # the lock goes free in this process at once; a forked child's copy never does
        threading.Timer(0.5, released.set).start()
        for _ in range(2):   # persistent processes, reused by the next task
            assert _consume_within(records, 90) == \
                [[i * i for i in range(a, min(a + 16, 40))] for a in (0, 16, 32)]
    finally:
        released.set()
        reader.close()


def test_a_stuck_loader_process_fails_the_task_naming_the_dataloader(monkeypatch):
    """A batch that never comes is a named, retryable task failure within the
    timeout (not bad data, not a freeze), and the loader's processes are stopped; the
    wait is made of polls (here 1 s, checking the processes live), which go on to the
    timeout."""
    from elasticdl.data import torch_dataset
    from elasticdl.data.torch_dataset import LoaderTimeout
    from tests.unit.data.loader_datasets import StuckInALoader

    monkeypatch.setattr(torch_dataset, "LOADER_POLL_S", 1.0)
    reader = TorchDatasetReader("/data/ds", StuckInALoader(32, stuck_at=20), num_workers=1,
                                timeout_s=3)
    records = TaskRecords(reader, _task(0, 32, shard="/data/ds"), "training", 8, _pair)
    started = time.monotonic()
    with pytest.raises(LoaderTimeout, match=r"/data/ds: the DataLoader delivered no batch "
                                            r"within 3 s loading records 16-24") as caught:
        _consume_within(records, 60)
    assert time.monotonic() - started < 30
    assert not isinstance(caught.value, DataError)   # retried, not the job failed
    assert reader._loader is None   # its processes were shut down with it


def test_a_stuck_in_thread_load_fails_the_task_within_the_timeout():
    """Without loader processes the prefetch thread loads; a stuck item there cannot be
    interrupted, but the consumer gives up after the timeout, naming the task."""
    from elasticdl.data.prefetch import PrefetchTimeout

    release = threading.Event()

    class Stuck(Squares):
        def __getitem__(self, i):
            if i == 5:
                release.wait(60)
            return super().__getitem__(i)

    reader = TorchDatasetReader("ds", Stuck(16), num_workers=0, timeout_s=2)
    records = TaskRecords(reader, _task(0, 16), "training", 4, _pair)
    try:
        with pytest.raises(PrefetchTimeout, match=r"minibatches-task-\d+: no item within 2 s"):
            _consume_within(records, 30)
    finally:
        release.set()
