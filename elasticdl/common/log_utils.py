"""Logging set-up, called once by each process's main (never at import)."""

from __future__ import annotations

import logging
import sys
from typing import Optional

FORMAT = "[%(asctime)s.%(msecs)03d] [%(levelname)s] [%(name)s] %(message)s"


def configure_logging(level: str = "INFO", role: Optional[str] = None) -> None:
    """Send log records to stderr with a role tag such as ``worker-1``."""
    fmt = FORMAT if role is None else f"[{role}] " + FORMAT
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
    # grpc and urllib3 are chatty at INFO
    for noisy in ("urllib3", "kubernetes", "grpc"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
