"""Progress of long work: a bar on a terminal, periodic log lines elsewhere."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Optional

logger = logging.getLogger(__name__)


def _fmt_eta(seconds: float) -> str:
    if seconds == float("inf") or seconds != seconds:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Counts records toward ``total`` and shows rate, ETA and extra fields.

    On a terminal it draws a tqdm bar; otherwise (CI, log files) it logs a
    line every ``interval_s`` seconds and once at :meth:`close`.
    """

    def __init__(self, total: int, desc: str, unit: str = "rec", interval_s: float = 5.0,
                 use_bar: Optional[bool] = None, clock: Any = time.monotonic):
        self.total = total
        self.desc = desc
        self.unit = unit
        self.done = 0
        self._clock = clock
        self._start = clock()
        self._last_log = self._start
        self._interval = interval_s
        self._fields: dict[str, Any] = {}
        self._bar = None
        if use_bar is None:
            use_bar = sys.stderr.isatty()
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)

    @property
    def rate(self) -> float:
        elapsed = self._clock() - self._start
        return self.done / elapsed if elapsed > 0 else 0.0

    def eta_s(self) -> float:
        rate = self.rate
        return (self.total - self.done) / rate if rate > 0 else float("inf")

    def update(self, n: int, **fields: Any) -> None:
        self.done += n
        self._fields.update(fields)
        if self._bar is not None:
            self._bar.update(n)
            if fields:
                self._bar.set_postfix(self._format_fields(), refresh=False)
            return
        now = self._clock()
        if now - self._last_log >= self._interval:
            self._last_log = now
            self._log()

    def _format_fields(self) -> dict[str, str]:
        return {k: (f"{v:.4f}" if isinstance(v, float) else str(v))
                for k, v in self._fields.items()}

    def _log(self) -> None:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        extra = " ".join(f"{k}={v}" for k, v in self._format_fields().items())
        logger.info("%s: %d/%d %s (%.1f%%) %.1f %s/s ETA %s %s", self.desc, self.done,
                    self.total, self.unit, pct, self.rate, self.unit, _fmt_eta(self.eta_s()),
                    extra)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._log()
