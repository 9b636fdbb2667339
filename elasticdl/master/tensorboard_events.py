"""TensorBoard scalars from the master, without torch or tensorflow: a bounded
in-memory queue, one writer thread, and the event file format written here.

:meth:`ScalarEventWriter.add_scalar` never blocks and costs about a microsecond
(the job core calls its listeners from gRPC handlers, under its lock): it
appends a tuple to a deque, takes no lock and wakes no thread; when the queue
is full the scalar is dropped and counted (``dropped``). Rare scalars that must
not be lost to a burst of frequent ones (evaluations, epochs, relaunches:
``keep=True``) go to a separate queue the thread drains first. The thread
wakes every ``poll_s``, encodes what is queued (the ``Event`` protobuf by hand:
a few fields), and writes it to the file every ``flush_secs`` and on
:meth:`flush` / :meth:`close`, the records' CRC32C checksums computed for the
whole batch at once with numpy (tensorboard's own writer computes them in pure
Python, ~0.2 ms per scalar, and runs one more thread: on a busy master that
cost a third of the dispatch rate).

Tags (see docs/observability.md): ``train/loss``, ``train/learning_rate``,
``train/records_per_second``, ``eval/<metric>``, ``job/relaunches``,
``job/epochs_completed``.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from typing import Any, Optional, Union

import numpy as np

from elasticdl.master.listeners import JobListener
from elasticdl.master.live_figures import RateMeter

logger = logging.getLogger(__name__)

_FILE_IDS = itertools.count()


def _crc_table() -> np.ndarray:
    table = np.zeros(256, dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table[i] = c
    return table


_TABLE = _crc_table()


def masked_crc32c_many(records: list[bytes]) -> list[int]:
    """The TFRecord checksum (CRC32C, masked) of each record, vectorised over
    records of equal length."""
    out = [0] * len(records)
    by_len: dict[int, list[int]] = {}
    for i, r in enumerate(records):
        by_len.setdefault(len(r), []).append(i)
    for length, idx in by_len.items():
        data = np.frombuffer(b"".join(records[i] for i in idx), dtype=np.uint8)
        data = data.reshape(len(idx), length)
        crc = np.full(len(idx), 0xFFFFFFFF, dtype=np.uint32)
        for j in range(length):
            crc = _TABLE[(crc ^ data[:, j]) & 0xFF] ^ (crc >> 8)
        crc ^= np.uint32(0xFFFFFFFF)
        masked = (((crc >> 15) | (crc << 17)) + np.uint32(0xA282EAD8)) & 0xFFFFFFFF
        for i, m in zip(idx, masked.tolist()):
            out[i] = m
    return out


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_TAGS: dict[str, bytes] = {}   # tag -> the event's bytes from field 5 to simple_value


def encode_scalar(tag: str, value: float, step: int, wall_time: float) -> bytes:
    """A serialised ``tensorboard.Event`` holding one scalar (``simple_value``)."""
    middle = _TAGS.get(tag)
    if middle is None:
        t = tag.encode("utf-8")
        # proto3 leaves out zero fields, except simple_value (a oneof member)
        val_head = (b"\x0a" + _varint(len(t)) + t if t else b"") + b"\x15"
        val_len = len(val_head) + 4
        summary_len = 1 + len(_varint(val_len)) + val_len
        middle = b"\x2a" + _varint(summary_len) + b"\x0a" + _varint(val_len) + val_head
        if len(_TAGS) < 10_000:
            _TAGS[tag] = middle
    head = _pack_wall(9, wall_time) if wall_time else b""
    if step:
        head += b"\x10" + (_varint(step) if not 0 < step < 128 else _SMALL[step])
    return head + middle + _pack_f(value)


_pack_wall = struct.Struct("<Bd").pack   # field 1 (wall_time), a double
_pack_f = struct.Struct("<f").pack
_SMALL = [bytes([i]) for i in range(128)]


def _file_version_event(wall_time: float) -> bytes:
    version = b"brain.Event:2"
    return b"\x09" + struct.pack("<d", wall_time) + b"\x1a" + _varint(len(version)) + version


class EventFile:
    """One TensorBoard event file; :meth:`add_event` buffers, :meth:`flush`
    checksums and writes the buffer (every ``max_buffer`` events at the latest)."""

    def __init__(self, logdir: str, filename_suffix: str = "", max_buffer: int = 8192):
        os.makedirs(logdir, exist_ok=True)
        now = time.time()
        self._file_name = os.path.join(logdir, (
            f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}."
            f"{next(_FILE_IDS)}{filename_suffix}"))
        self._file = open(self._file_name, "wb")  # noqa: SIM115 - closed by close()
        self._buffer: list[bytes] = []
        self._max_buffer = max_buffer
        self._header_crcs: dict[int, bytes] = {}
        self.add_event(_file_version_event(now))
        self.flush()

    def add_event(self, event: Union[bytes, Any]) -> None:
        """Queue one event (serialised, or a protobuf ``Event``)."""
        self._buffer.append(event if isinstance(event, bytes) else event.SerializeToString())
        if len(self._buffer) >= self._max_buffer:
            self._write()

    def _write(self) -> None:
        records, self._buffer = self._buffer, []
        if not records:
            return
        parts: list[bytes] = []
        for data, crc in zip(records, masked_crc32c_many(records)):
            header = struct.pack("<Q", len(data))
            hcrc = self._header_crcs.get(len(data))
            if hcrc is None:
                hcrc = self._header_crcs[len(data)] = struct.pack(
                    "<I", masked_crc32c_many([header])[0])
            parts += (header, hcrc, data, struct.pack("<I", crc))
        self._file.write(b"".join(parts))

    def flush(self) -> None:
        self._write()
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()


_Scalar = tuple[str, float, int, float]


class ScalarEventWriter:
    """Scalars into one new event file in ``logdir`` (a restarted master adds
    its own file next to the earlier ones; TensorBoard reads them all)."""

    def __init__(self, logdir: str, max_queue: int = 65536, flush_secs: float = 5.0,
                 poll_s: float = 0.1):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.logdir = logdir
        self.flush_secs = flush_secs
        self.poll_s = poll_s
        self.dropped = 0
        self._max_queue = max_queue
        self._queue: deque[_Scalar] = deque()
        self._kept: deque[_Scalar] = deque()
        self._closed = False
        self._wake = threading.Event()
        self._flushes: deque[threading.Event] = deque()   # flush() callers waiting
        self._writer = EventFile(logdir, filename_suffix=".elasticdl")
        self._thread = threading.Thread(target=self._run, name="tensorboard-writer",
                                        daemon=True)
        self._thread.start()

    @property
    def path(self) -> str:
        return str(self._writer._file_name)

    def add_scalar(self, tag: str, value: float, step: int,
                   wall_time: Optional[float] = None, keep: bool = False) -> bool:
        """Queue one scalar; False (and ``dropped`` + 1) when its queue is full or
        the writer is closed. ``keep``: a rare scalar, queued apart from the
        frequent ones (written first). Never blocks."""
        queue = self._kept if keep else self._queue
        if self._closed or len(queue) >= self._max_queue:
            return self._drop()
        queue.append((tag, float(value), int(step),
                      time.time() if wall_time is None else wall_time))
        return True

    def _drop(self) -> bool:
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 1000 == 0:
            logger.warning("TensorBoard writer queue full or closed: %d scalar(s) dropped so "
                           "far", self.dropped)
        return False

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Write what is queued now and flush the file; False if that took longer
        than ``timeout_s`` (or the writer is closed)."""
        if self._closed or not self._thread.is_alive():
            return False
        done = threading.Event()
        self._flushes.append(done)
        self._wake.set()
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, flush and close the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("TensorBoard writer did not drain its queue in %.0f s", timeout_s)

    def _drain(self) -> None:
        for queue in (self._kept, self._queue):   # rare scalars first
            while queue:
                self._writer.add_event(encode_scalar(*queue.popleft()))

    def _run(self) -> None:
        next_flush = time.monotonic() + self.flush_secs
        while True:
            self._wake.wait(self.poll_s)
            self._wake.clear()
            closing = self._closed
            waiting = len(self._flushes)
            self._drain()
            if closing:
                self._writer.close()
                while self._flushes:
                    self._flushes.popleft().set()
                return
            if waiting or time.monotonic() >= next_flush:
                self._writer.flush()
                next_flush = time.monotonic() + self.flush_secs
            for _ in range(waiting):
                self._flushes.popleft().set()


class TensorBoardListener(JobListener):
    """The job core's events as scalars. Counts continue from the core's state
    (a restarted master goes on where the journal left off)."""

    def __init__(self, writer: ScalarEventWriter, core: Any, rate_interval_s: float = 2.0):
        self.writer = writer
        self.rate_interval_s = rate_interval_s
        self._meter = RateMeter(window_s=max(rate_interval_s * 5, 10.0))
        self._last_rate = time.monotonic()
        self.relaunches = len(core.report.relaunches)
        total = core.tm.training_records
        self.epochs_completed = sum(1 for e in core.tm.epochs_report()
                                    if total and e["records_completed"] >= total)
        writer.add_scalar("job/relaunches", self.relaunches, core.version, keep=True)
        writer.add_scalar("job/epochs_completed", self.epochs_completed, core.version,
                          keep=True)

    def on_training_task(self, epoch: int, records: int, loss: Optional[float],
                         learning_rate: Optional[float], version: int) -> None:
        if loss is not None:
            self.writer.add_scalar("train/loss", loss, version)
        if learning_rate is not None:
            self.writer.add_scalar("train/learning_rate", learning_rate, version)
        self._meter.add(records)
        now = time.monotonic()
        if now - self._last_rate >= self.rate_interval_s:
            self._last_rate = now
            self.writer.add_scalar("train/records_per_second", self._meter.rate(), version)

    def on_evaluation(self, version: int, metrics: dict[str, float]) -> None:
        for name, value in sorted(metrics.items()):
            self.writer.add_scalar(f"eval/{name}", value, version, keep=True)

    def on_epoch_end(self, epoch: int, version: int) -> None:
        self.epochs_completed += 1
        self.writer.add_scalar("job/epochs_completed", self.epochs_completed, version,
                               keep=True)

    def on_relaunch(self, replica: str, new_replica: str, reason: str, version: int) -> None:
        self.relaunches += 1
        self.writer.add_scalar("job/relaunches", self.relaunches, version, keep=True)
