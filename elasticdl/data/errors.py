"""The errors of reading data, apart from the reader interface (:mod:`elasticdl.data.api`
re-exports them) so that the modules under it (the object-storage layer
:mod:`elasticdl.data.fs`) raise them without importing the interface that uses them."""

from __future__ import annotations

from typing import Any

__all__ = ["DataError", "MalformedRecordError"]


class DataError(Exception):
    """Data cannot be read: missing path, unknown format, unreadable or inconsistent file.

    The message always names the offending path.
    """


class MalformedRecordError(DataError):
    """One record of a file cannot be parsed.

    Attributes:
        path: the file holding the record.
        record_index: 0-based index of the record within the file (header lines not counted).
        reason: why the record is malformed, e.g. ``"expected 3 fields, got 2"``.
    """

    def __init__(self, path: str, record_index: int, reason: str) -> None:
        super().__init__(f"{path}: malformed record {record_index}: {reason}")
        self.path = path
        self.record_index = record_index
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the exception picklable (it may cross a process boundary).
        return (type(self), (self.path, self.record_index, self.reason))
