"""A model module's ``dataset(path, mode)`` as a reader, loaded through a torch DataLoader.

A model module may define ``dataset(path, mode)`` returning a map-style
``torch.utils.data.Dataset`` (``__getitem__`` and ``__len__``). The dataset is one shard
named by ``path`` (the ``--training_data``/``--validation_data``/``--prediction_data``
value, which need not be a file) holding ``len(dataset)`` records; the master cuts it
into tasks of index ranges like any reader's shard. A worker loads the minibatches of a
task with a real :class:`torch.utils.data.DataLoader` over exactly the indices of each
minibatch (a batch sampler: minibatch k of a task holds the same records on every try),
``--data_loader_workers`` worker processes (persistent across tasks), ``pin_memory`` on
CUDA, and the module's ``collate_fn`` or ``default_collate``.

Loader processes are never forked from the worker: a worker runs gRPC's threads, the
prefetch thread and the trainer, and a lock one of them holds at a ``fork`` stays held
forever in the child (its first ``logging`` call, allocator or import then blocks, and the
DataLoader waits for a batch that never comes). They start from a ``forkserver`` (a
clean single-threaded process that imports torch once; ``spawn`` where the platform has
no forkserver), so they hold no lock of the worker's. Every batch is awaited for at most
``--data_loader_timeout_s``: a stuck loader fails the task naming the DataLoader
(:class:`LoaderTimeout`, a retryable error: the master re-queues the task), its
processes stopped, instead of freezing the worker until the task's lease expires.

A loader process exits within a second of the worker that made it (:class:`ExitWithOwner`):
its parent is the forkserver, not the worker, so torch's own watchdog (which watches the
parent) never fires, and a worker killed, or exiting without closing its DataLoader, would
leave its loader processes and the forkserver they keep alive running forever.

Imports torch: workers and Local jobs only. The master learns the size without torch
(:mod:`elasticdl.data.dataset_source`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data import default_collate as torch_default_collate

from elasticdl.data.api import DataError, DataReader, MalformedRecordError, Shard

logger = logging.getLogger(__name__)

__all__ = ["BatchLoadError", "LoaderTimeout", "TorchDatasetReader", "check_map_style",
           "loader_context"]

DEFAULT_TIMEOUT_S = 120.0


class BatchLoadError(DataError):
    """Loading a minibatch failed although every record of it loads and collates alone."""


class LoaderTimeout(RuntimeError):
    """The DataLoader delivered no batch within its timeout: a stuck loader, not bad
    data (a retryable task failure)."""


def loader_context() -> Any:
    """The multiprocessing context of loader processes: ``forkserver`` (preloading
    torch, so each process starts in milliseconds once the server runs), else
    ``spawn``; never ``fork`` (module docs)."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.utils.data"])
        return ctx
    return multiprocessing.get_context("spawn")


LOADER_POLL_S = 5.0
"""How often a wait for a batch from loader processes checks that they live."""


def _process_start(pid: int) -> Optional[str]:
    """The start time of a live (not zombie) process, None when it is gone: a pid and its
    start time name one process even after the pid is reused. Where there is no /proc,
    the pid alone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return "alive"
    return None if fields[0] in ("Z", "X") else fields[19]   # state; field 22 starttime


class ExitWithOwner:
    """``worker_init_fn`` of loader processes: a daemon thread that ends the process
    (``os._exit``) once the process that built the DataLoader is gone, checked every
    ``interval_s`` (module docs)."""

    def __init__(self, interval_s: float = 1.0):
        self.pid = os.getpid()
        self.start = _process_start(self.pid)
        self.interval_s = interval_s

    def __call__(self, worker_id: int) -> None:
        threading.Thread(target=self._watch, name="elasticdl-owner-watch",
                         daemon=True).start()

    def _watch(self) -> None:
        while _process_start(self.pid) == self.start:
            time.sleep(self.interval_s)
        os._exit(0)


def check_map_style(dataset: Any, where: str) -> int:
    """``len(dataset)`` of a map-style dataset.

    Raises:
        DataError: ``dataset`` is iterable-style, has no ``__getitem__``/``__len__``, or its
            length is not a non-negative integer (named with ``where``).
    """
    if isinstance(dataset, IterableDataset):
        raise DataError(f"{where} returned an IterableDataset ({type(dataset).__name__}); "
                        "tasks are index ranges, so a map-style dataset (__getitem__ and "
                        "__len__) is needed")
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise DataError(f"{where} returned {type(dataset).__name__}, not a map-style "
                        "dataset (__getitem__ and __len__)")
    try:
        size = len(dataset)
    except Exception as e:  # noqa: BLE001 - user code; re-raised as a data error
        raise DataError(f"{where}: len() of the dataset failed: {type(e).__name__}: {e}") from e
    if not isinstance(size, int) or size < 0:
        raise DataError(f"{where}: len() of the dataset is {size!r}, not a count")
    return size


class _Ranges:
    """A batch sampler whose batches are set per task: the index lists of minibatches."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        for start, stop in self.ranges:
            yield list(range(start, stop))

    def __len__(self) -> int:
        return len(self.ranges)


class TorchDatasetReader(DataReader):
    """One shard ``path`` of ``len(dataset)`` records, read through a DataLoader.

    Args:
        path: the shard name (the job's data flag value).
        dataset: a map-style dataset.
        collate_fn: the module's ``collate_fn``, or None for ``default_collate``.
        num_workers: DataLoader worker processes (0: load in the calling thread).
        pin_memory: pin collated tensors (set when training on CUDA).
        timeout_s: the longest wait for one batch (loader processes: the DataLoader's own
            ``timeout``; in-thread loading: the prefetching consumer's bound,
            :attr:`item_timeout_s`); 0 waits forever.
    """

    def __init__(self, path: str, dataset: Any, collate_fn: Optional[Callable[..., Any]] = None,
                 num_workers: int = 0, pin_memory: bool = False, where: str = "dataset",
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.path = path
        self.dataset = dataset
        self.size = check_map_style(dataset, where)
        self.collate_fn = collate_fn
        self.num_workers = int(num_workers)
        self.pin_memory = bool(pin_memory)
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self._sampler = _Ranges()
        self._loader: Optional[DataLoader] = None
        self._lock = threading.Lock()   # one iteration of the loader at a time

    # ------------------------------------------------------------------ DataReader
    def create_shards(self) -> list[Shard]:
        if not self.size:
            logger.info("dataset %s holds no records; no shard created", self.path)
            return []
        return [Shard(self.path, 0, self.size)]

    def num_records(self) -> int:
        return self.size

    def check_range(self, name: str, start: int, end: int) -> None:
        """Raises DataError / ValueError for a range that is not of this dataset."""
        if name != self.path:
            raise DataError(f"{name}: not the dataset of this reader ({self.path})")
        if start < 0 or start > end or end > self.size:
            raise ValueError(f"{self.path}: invalid record range [{start}, {end}) for a "
                             f"dataset of {self.size} records (did the data change since "
                             "the master sharded it?)")

    def read(self, name: str, start: int, end: int) -> list[Any]:
        """The items ``dataset[start:end]``, uncollated (one by one, no DataLoader)."""
        self.check_range(name, start, end)
        return [self._item(i) for i in range(start, end)]

    @property
    def item_timeout_s(self) -> Optional[float]:
        """How long a consumer of :meth:`batches` waits for one batch (None: forever).
        With loader processes the DataLoader's own timeout fires first and names the
        records; this bound is then a backstop (a pin-memory thread, a collate in
        this process) twice as long."""
        if not self.timeout_s:
            return None
        return self.timeout_s if self.num_workers == 0 else 2 * self.timeout_s + 10.0

    def close(self) -> None:
        """Stop the loader processes (a new loader starts at the next :meth:`batches`);
        a no-op, logged, while a :meth:`batches` iteration that does not end within a
        few seconds holds the loader."""
        if not self._lock.acquire(timeout=5.0):
            logger.warning("%s: the DataLoader is in use; its processes were not stopped",
                           self.path)
            return
        try:
            self._drop_loader()
        finally:
            self._lock.release()

    def _drop_loader(self) -> None:
        loader, self._loader = self._loader, None
        it = getattr(loader, "_iterator", None)
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:   # joins each process briefly, then terminates it
            shutdown()

    # ------------------------------------------------------------------ loading
    def collate(self, items: list[Any]) -> Any:
        fn = self.collate_fn or torch_default_collate
        return fn(items)

    def load(self, start: int, stop: int) -> Any:
        """Records ``[start, stop)`` collated, in this thread; a failure names the record
        (the dataset's item or the collate function rejecting it)."""
        items = [self._item(i) for i in range(start, stop)]
        try:
            return self.collate(items)
        except Exception as batch_error:  # noqa: BLE001 - located below
            for i, item in zip(range(start, stop), items):
                try:
                    self.collate([item])
                except Exception as e:  # noqa: BLE001 - named and re-raised
                    raise MalformedRecordError(self.path, i, f"collate rejected it: "
                                               f"{type(e).__name__}: {e}") from e
            raise BatchLoadError(f"{self.path}: collating records {start}-{stop} failed: "
                                 f"{type(batch_error).__name__}: {batch_error}"
                                 ) from batch_error

    def _item(self, i: int) -> Any:
        try:
            return self.dataset[i]
        except Exception as e:  # noqa: BLE001 - user code: a structured data error
            raise MalformedRecordError(self.path, i, f"dataset[{i}] raised "
                                       f"{type(e).__name__}: {e}") from e

    def batches(self, ranges: Sequence[tuple[int, int]]) -> Generator[Any, None, None]:
        """The collated minibatches of ``ranges`` (absolute index ranges), in order,
        through the DataLoader. A failing batch is loaded again record by record to
        name the bad record (:meth:`load`)."""
        if not ranges:
            return
        with self._lock:
            loader = self._get_loader()
            self._sampler.ranges = list(ranges)
            it = iter(loader)
            done = 0
            try:
                while True:
                    try:
                        batch = self._next_batch(it)
                    except StopIteration:
                        break
                    yield batch
                    done += 1
            except Exception as e:  # noqa: BLE001 - located, or re-raised as it is
                self._drop_loader()   # a fresh loader (and worker processes) next time
                start, stop = ranges[done]
                if isinstance(e, RuntimeError) and "DataLoader timed out" in str(e):
                    # a loader process is stuck (not the data: loading it again in this
                    # thread could block the same way): fail the task, retryably
                    raise LoaderTimeout(
                        f"{self.path}: the DataLoader delivered no batch within "
                        f"{self.timeout_s:g} s loading records {start}-{stop} "
                        f"({self.num_workers} loader process(es), stopped); the task is "
                        "handed back (--data_loader_timeout_s)") from e
                logger.warning("%s: loading records %d-%d failed (%s: %s); loading them one "
                               "by one to find the record", self.path, start, stop,
                               type(e).__name__, e)
                self.load(start, stop)
                if isinstance(e, (ConnectionError, EOFError)) or \
                        "exited unexpectedly" in str(e):
                    # a loader process died (a signal, memory) or its pipe broke, not the
                    # data: every record loads alone; a plain error, so the task is retried
                    # on a fresh loader instead of failing the job as bad data
                    raise RuntimeError(f"{self.path}: a DataLoader worker process died "
                                       f"loading records {start}-{stop}: "
                                       f"{type(e).__name__}: {e}") from e
                raise BatchLoadError(f"{self.path}: loading records {start}-{stop} failed: "
                                     f"{type(e).__name__}: {e}") from e

    def _next_batch(self, it: Iterator[Any]) -> Any:
        """``next(it)`` within :attr:`timeout_s`. The DataLoader's own timeout is a poll of
        at most :data:`LOADER_POLL_S`: at each, it checks that its processes live and
        raises "exited unexpectedly" for a dead one (a forkserver's child is not this
        process's: no SIGCHLD tells the DataLoader, which would otherwise learn of the
        death only at the whole timeout); a poll that times out with every process alive
        waits on, up to the timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return next(it)
            except RuntimeError as e:
                if "DataLoader timed out" not in str(e) or time.monotonic() >= deadline:
                    raise

    def _get_loader(self) -> DataLoader:
        if self._loader is None:
            workers = self.num_workers
            self._loader = DataLoader(
                self.dataset, batch_sampler=self._sampler,
                collate_fn=self.collate_fn or torch_default_collate,
                num_workers=workers, pin_memory=self.pin_memory and torch.cuda.is_available(),
                persistent_workers=workers > 0, prefetch_factor=2 if workers > 0 else None,
                multiprocessing_context=loader_context() if workers > 0 else None,
                worker_init_fn=ExitWithOwner() if workers > 0 else None,
                timeout=min(self.timeout_s, LOADER_POLL_S) if workers > 0 else 0,
                # its own generator: an iterator's base seed never draws from the global
                # RNG, which the training thread's dropout uses (runs stay reproducible)
                generator=torch.Generator().manual_seed(0))
        return self._loader


def pin_memory_default(device: str) -> bool:
    """Pin host memory when the job trains on CUDA (``--device`` auto or cuda)."""
    return device != "cpu" and torch.cuda.is_available()


def dataset_readers(model_spec: Any, paths: dict[Any, tuple[str, str]], num_workers: int,
                    pin_memory: bool, timeout_s: float = DEFAULT_TIMEOUT_S
                    ) -> dict[Any, TorchDatasetReader]:
    """``{key: reader}`` for ``{key: (path, mode)}`` from the module's ``dataset``.

    Raises:
        DataError: ``dataset`` raised, or returned something that is not a map-style
            dataset (named with the module path).
    """
    out = {}
    for key, (path, mode) in paths.items():
        where = f"dataset({path!r}, {mode!r}) of {model_spec.module_path}"
        try:
            ds = model_spec.call(model_spec.dataset, path, mode)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - user code; re-raised naming it
            raise DataError(f"{where} failed: {type(e).__name__}: {e}") from e
        out[key] = TorchDatasetReader(path, ds, model_spec.collate_fn, num_workers,
                                      pin_memory, where=where, timeout_s=timeout_s)
    return out
