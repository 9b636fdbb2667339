"""An on-disk audit trail of every push a PS applied (``--output`` only).

The in-memory ledger (:mod:`elasticdl.common.ledger`) forgets the minibatches of
tasks the master closed; for audits (``output/ps-<i>-ledger.json`` at the end
of a job, which tests read to show every identity applied exactly once) the
PS appends each applied ``(task, minibatch, records, version)`` as 32 bytes to
``output/ps-<i>-applied.bin``. It is never read while the job runs: memory and
checkpoints stay O(live).

The file follows the model's history: after a restore of version ``V`` (a
relaunched PS, a rollback) it is cut after the last entry of a version
``<= V`` (versions grow along the file), exactly what the restored
parameters hold. It is flushed whenever a checkpoint is taken, so a killed PS
loses only entries a rollback discards anyway.
"""

from __future__ import annotations

import logging
import os
from array import array
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_ROW = 4 * 8   # four int64 per entry
_FLUSH_AT = 8192   # buffered entries


class AuditLog:
    """Append-only file of applied pushes (thread safety: the shard's lock)."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "ab"):
            pass
        size = os.path.getsize(path)
        if size % _ROW:   # a PS killed mid-write: the torn last entry goes
            os.truncate(path, size - size % _ROW)
        self._buf = array("q")

    def append(self, task: int, minibatch: int, records: int, version: int) -> None:
        self._buf.extend((task, minibatch, records, version))
        if len(self._buf) >= 4 * _FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        if self._buf:
            with open(self.path, "ab") as f:
                self._buf.tofile(f)
            self._buf = array("q")

    def truncate_after(self, version: int) -> None:
        """Keep only entries of versions ``<= version`` (binary search on the file)."""
        self.flush()
        n = os.path.getsize(self.path) // _ROW
        lo, hi = 0, n
        with open(self.path, "rb") as f:
            while lo < hi:
                mid = (lo + hi) // 2
                f.seek(mid * _ROW)
                row = array("q")
                row.frombytes(f.read(_ROW))
                if row[3] <= version:
                    lo = mid + 1
                else:
                    hi = mid
        if lo < n:
            logger.info("audit %s: %d entries after version %d dropped", self.path, n - lo,
                        version)
            os.truncate(self.path, lo * _ROW)

    def clear(self) -> None:
        self._buf = array("q")
        os.truncate(self.path, 0)

    def entries(self) -> Iterator[tuple[int, int, int, int]]:
        """Every entry, in order (reads the file in blocks)."""
        self.flush()
        with open(self.path, "rb") as f:
            while True:
                block = f.read(_ROW * 65536)
                if not block:
                    return
                rows = array("q")
                rows.frombytes(block)
                for i in range(0, len(rows), 4):
                    yield rows[i], rows[i + 1], rows[i + 2], rows[i + 3]
