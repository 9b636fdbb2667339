"""The job core's write-ahead journal: what a restarted master continues from.

A journal directory (``<job_dir>/journal``) holds one snapshot and the
journal segments after it::

    snapshot.json                 {"seq": S, "state": JobCore.state_dict(), "extra": {...}}
    journal-000000000042.jsonl    one JSON record per line, "seq" 42, 43, ...

Every state-changing call of the :class:`~elasticdl.master.job.JobCore` appends
one record (the call and its arguments, the core's clock at the time and, for a
task handed out, which one) and fsyncs it *before* the call returns, so before
the gRPC reply acknowledges it. A snapshot is written to a temporary file,
fsynced and renamed over ``snapshot.json``; the segments it covers are removed
afterwards. :meth:`Journal.load` gives the snapshot and the records after it;
the core replays them (:meth:`JobCore.restore`). A record cut short by a kill
(the last line of a segment) was never acknowledged and is dropped; a
damaged record anywhere else raises :class:`JournalError`.

One master writes a job's journal at a time: :class:`JournalOwner` is an
exclusive ``flock`` on ``<job_dir>/journal.lock``, taken before the journal is
read and released when it is closed (or the process dies). A replacement
master pod can start while the one it replaces is still ending (SIGTERM,
serving its last RPCs, journaling them): it waits for the lock, so it reads a
journal nobody appends to any more.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
import threading
import time
from typing import IO, Any, Optional

logger = logging.getLogger(__name__)

JOURNAL_DIR = "journal"                   # in the job directory
LOCK_FILE = "journal.lock"                # in the job directory (JournalOwner)
RESTARTS_FILE = "master_restarts.json"    # the launcher's notes of each master death
SNAPSHOT = "snapshot.json"
_SEGMENT = re.compile(r"^journal-(\d{12})\.jsonl$")
_SEQ = re.compile(r'^\{"seq":(\d+),')


class JournalError(RuntimeError):
    """The journal cannot be read or replayed (message names the file and record)."""


class JournalLockedError(JournalError):
    """Another master holds the journal (the message names it)."""


class JournalOwner:
    """The right to write one job's journal: an exclusive ``flock`` on ``path``
    (advisory; local file systems and NFSv4 honour it), held from
    :meth:`acquire` until :meth:`release` or the process's death. The holder's
    pid and host are written into the file for the error message of a master
    that cannot take it."""

    def __init__(self, path: str):
        self.path = path
        self._fd: Optional[int] = None

    def acquire(self, wait_s: float) -> None:
        """Take the lock, waiting up to ``wait_s``; :class:`JournalLockedError` naming
        the holder when another process keeps it longer. A file system without
        ``flock`` is warned about and the journal used unlocked."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = self._holder(fd)
                    os.close(fd)
                    raise JournalLockedError(
                        f"the job's journal is held by another master ({holder}) after "
                        f"{wait_s:.0f} s: {self.path}") from None
                if not waited:
                    logger.info("waiting up to %.0f s for the master holding the journal "
                                "(%s) to end", wait_s, self._holder(fd))
                    waited = True
                time.sleep(0.2)
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    os.close(fd)
                    raise
                logger.warning("cannot lock %s (%s): two masters of this job could write its "
                               "journal at once", self.path, e)
                break
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            return os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        except OSError:
            return "unknown"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)   # closing the descriptor drops the flock
            self._fd = None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """An append-only journal with snapshots in ``directory`` (created if missing).

    Not thread-safe by itself for ordering: the core appends under its own lock,
    so the journal's order is the order the transitions happened in.
    """

    def __init__(self, directory: str, fsync: bool = True,
                 owner: Optional[JournalOwner] = None):
        self.directory = directory
        self.owner = owner   # released by close()
        self.fsync = fsync
        os.makedirs(directory, exist_ok=True)
        self._io_lock = threading.Lock()
        self.snapshot_lock = threading.Lock()   # one snapshot written at a time
        self._file: Optional[IO[str]] = None
        self._rotated: list[IO[str]] = []   # segments rotate() left, closed by write_snapshot
        self._sync_lock = threading.Lock()
        self._synced = 0                # records known to be on disk
        self.seq = 0                    # the last record's sequence number
        self.records_since_snapshot = 0
        snap, records = self.load()
        self._drop_torn_tail()
        if snap is not None:
            self.seq = int(snap["seq"])
        if records:
            self.seq = int(records[-1]["seq"])
        # what was read here, for a restore before anything is appended (read once)
        self._loaded: Optional[tuple[Optional[dict[str, Any]], list[dict[str, Any]]]] = (
            snap, records)

    def load_once(self) -> tuple[Optional[dict[str, Any]], list[dict[str, Any]]]:
        """:meth:`load`, reusing what the constructor read if nothing was
        appended since (a restore reads the journal once)."""
        loaded, self._loaded = self._loaded, None
        return loaded if loaded is not None else self.load()

    # ------------------------------------------------------------ writing
    def _segments(self) -> list[tuple[int, str]]:
        found = []
        for name in os.listdir(self.directory):
            m = _SEGMENT.match(name)
            if m:
                found.append((int(m.group(1)), os.path.join(self.directory, name)))
        return sorted(found)

    def _open_segment(self) -> IO[str]:
        path = os.path.join(self.directory, f"journal-{self.seq + 1:012d}.jsonl")
        f = open(path, "a", encoding="utf-8")
        if self.fsync:
            _fsync_dir(self.directory)
        return f

    def _drop_torn_tail(self) -> None:
        """Cut a record a kill left unfinished off the last segment (appends go on
        after the last complete record)."""
        segments = self._segments()
        if not segments:
            return
        path = segments[-1][1]
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)

    def append(self, record: dict[str, Any], sync: bool = True) -> int:
        """Write one record (flushed to the OS); its sequence number. ``sync``:
        fsync it now; else :meth:`sync` must run before it is acknowledged (group
        commit: callers append under their lock, then sync outside it, and one
        fsync covers every record written meanwhile)."""
        with self._io_lock:
            self._loaded = None
            if self._file is None:
                self._file = self._open_segment()
            self.seq += 1
            line = json.dumps({"seq": self.seq, **record}, separators=(",", ":"))
            self._file.write(line + "\n")
            self._file.flush()
            self.records_since_snapshot += 1
            seq = self.seq
        if sync:
            self.sync()
        return seq

    def sync(self) -> None:
        """Every record appended so far is on disk when this returns."""
        if not self.fsync:
            return
        with self._sync_lock:
            with self._io_lock:
                target, f = self.seq, self._file
                if target <= self._synced:
                    return
                fds = [os.dup(x.fileno()) for x in self._rotated + ([f] if f else [])]
            try:
                for fd in fds:
                    os.fsync(fd)
            finally:
                for fd in fds:
                    os.close(fd)
            self._synced = target

    def rotate(self) -> int:
        """Start a new segment; the sequence number the snapshot being taken has.
        Call it together with the state capture (under the core's lock): it only
        sets the current segment aside (no disk wait); :meth:`write_snapshot`
        fsyncs and closes it, and :meth:`sync` covers it meanwhile."""
        with self._io_lock:
            self._loaded = None
            if self._file is not None:
                self._rotated.append(self._file)
                self._file = None
            self.records_since_snapshot = 0
            return self.seq

    def _close_rotated(self) -> None:
        self.sync()   # the set-aside segments too
        with self._io_lock:
            rotated, self._rotated = self._rotated, []
        for f in rotated:
            f.close()

    def write_snapshot(self, seq: int, state: dict[str, Any], extra: dict[str, Any]) -> None:
        """Atomically replace the snapshot with ``state`` as of record ``seq``,
        then remove the segments it covers. The caller holds :attr:`snapshot_lock`
        from :meth:`rotate` to here (snapshots land in the order taken)."""
        self._close_rotated()
        path = os.path.join(self.directory, SNAPSHOT)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            # dumps, not dump: the C encoder (dump streams through the Python one)
            f.write(json.dumps({"seq": seq, "state": state, "extra": extra},
                               separators=(",", ":")))
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if self.fsync:
            _fsync_dir(self.directory)
        segments = self._segments()
        for i, (_, seg) in enumerate(segments):
            nxt = segments[i + 1][0] if i + 1 < len(segments) else None
            if nxt is not None and nxt <= seq + 1:   # every record in it is <= seq
                os.unlink(seg)

    def close(self) -> None:
        with self._io_lock:
            for f in self._rotated:
                f.close()
            self._rotated = []
            if self._file is not None:
                self._file.close()
                self._file = None
            if self.owner is not None:
                self.owner.release()
                self.owner = None

    # ------------------------------------------------------------ reading
    def load(self) -> tuple[Optional[dict[str, Any]], list[dict[str, Any]]]:
        """The snapshot (None if none yet) and the records after it, in order."""
        snap = None
        path = os.path.join(self.directory, SNAPSHOT)
        if os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    snap = json.load(f)
            except ValueError as e:
                raise JournalError(f"{path}: damaged snapshot: {e}") from e
        after = int(snap["seq"]) if snap is not None else 0
        records: list[dict[str, Any]] = []
        segments = self._segments()
        for _, seg in segments:
            with open(seg, encoding="utf-8") as f:
                lines = f.read().split("\n")
            for n, line in enumerate(lines):
                if not line:
                    continue
                m = _SEQ.match(line)   # a record the snapshot covers: not parsed
                if m is not None and int(m.group(1)) <= after and n < len(lines) - 1:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    if n == len(lines) - 1:  # no newline after it: cut short by a kill
                        logger.warning("%s: dropped a record cut short (never "
                                       "acknowledged)", seg)
                        continue
                    raise JournalError(f"{seg} line {n + 1}: damaged record: {e}") from e
                if rec["seq"] <= after:
                    continue
                if records and rec["seq"] != records[-1]["seq"] + 1 or \
                        not records and rec["seq"] != after + 1:
                    raise JournalError(f"{seg} line {n + 1}: record {rec['seq']} does not "
                                       f"follow {records[-1]['seq'] if records else after}")
                records.append(rec)
        return snap, records

    def exists(self) -> bool:
        """Whether anything was journaled here (a master to restore)."""
        return os.path.exists(os.path.join(self.directory, SNAPSHOT)) or \
            bool(self._segments())
