"""Tasks carry their records' bytes: the master's CSV/text index gives each task its byte
span (``Shard.byte_start/byte_end/num_fields``), and a worker reads exactly those bytes with
no index of its own (on object storage: one ranged GET per task instead of streaming every
object it reads once to index it). A span that no longer matches the file fails clearly."""

from __future__ import annotations

import pytest

from elasticdl.common.task import Task, TaskType
from elasticdl.common.wire import task_from_proto, task_to_proto
from elasticdl.data import csv_reader
from elasticdl.data.api import DataError, MalformedRecordError
from elasticdl.data.csv_reader import CSVDataReader, TextDataReader
from elasticdl.worker.minibatches import TaskRecords


def _write(path, text: str) -> str:
    path.write_bytes(text.encode())
    return str(path)


def test_a_worker_reads_the_masters_spans_without_an_index(tmp_path, monkeypatch):
    rows = [f"{i},{'x' * (i % 7)},{i * i}" for i in range(50)]
    path = _write(tmp_path / "d.csv", "a,b,c\r\n" + "\r\n".join(rows) + "\r\n")
    master = CSVDataReader([path], header=True)
    assert master.count(path) == 50
    spans = {(s, e): master.span(path, s, e) for s, e in ((0, 16), (16, 32), (32, 50),
                                                           (7, 7))}
    worker = CSVDataReader([path], header=True)
    read: list[tuple[int, int]] = []
    real = csv_reader._read_span
    monkeypatch.setattr(csv_reader, "_read_span",
                        lambda p, b, e: (read.append((b, e)), real(p, b, e))[1])
    monkeypatch.setattr(csv_reader, "build_line_index", lambda *a, **k: pytest.fail("indexed"))
    for (s, e), span in spans.items():
        assert span is not None and span[2] == 3
        assert worker.read_span(path, s, e, span) == [r.split(",") for r in rows[s:e]]
    # exactly the spans' bytes, one read each (the empty task reads nothing)
    assert read == [spans[(0, 16)][:2], spans[(16, 32)][:2], spans[(32, 50)][:2]]
    # through the wire and the worker's task records
    task = Task(7, TaskType.TRAINING, path, 16, 32, span=spans[(16, 32)])
    back = task_from_proto(task_to_proto(task))
    assert back.span == spans[(16, 32)] and back == task
    records = TaskRecords(worker, back, "training", 4, lambda f: f)
    assert records.records == [r.split(",") for r in rows[16:32]]
    assert task_from_proto(task_to_proto(Task(8, TaskType.TRAINING, path, 0, 4))).span is None


def test_spans_of_text_files_the_last_line_without_a_newline(tmp_path, monkeypatch):
    path = _write(tmp_path / "t.txt", "one\ntwo\n\nfour")
    span = TextDataReader([path]).span(path, 1, 4)
    monkeypatch.setattr(csv_reader, "build_line_index", lambda *a, **k: pytest.fail("indexed"))
    assert TextDataReader([path]).read_span(path, 1, 4, span) == ["two", "", "four"]


def test_a_changed_file_or_a_bad_record_fails_clearly(tmp_path):
    path = _write(tmp_path / "d.csv", "1,2\n3,4\n5,6\n7,8\n")
    span = CSVDataReader([path]).span(path, 1, 3)
    _write(tmp_path / "d.csv", "1,2\n3,4,5\n5,6\n7,8\n")   # rewritten: one byte more
    with pytest.raises(MalformedRecordError, match=r"expected 2 fields, got 3"):
        CSVDataReader([path]).read_span(path, 1, 3, span)
    _write(tmp_path / "d.csv", "1,2\n3\n4\n5,6\n7,8\n")     # a line more in the span
    with pytest.raises(DataError, match="changed since it was indexed"):
        CSVDataReader([path]).read_span(path, 1, 3, span)
    with pytest.raises(ValueError, match="invalid span"):
        CSVDataReader([path]).read_span(path, 1, 3, (9, 2, 2))
    _write(tmp_path / "d.csv", "1,2\n3,\xff4\n5,6\n")
    raw = (tmp_path / "d.csv").read_bytes().replace("\xff".encode(), b"\xff")
    (tmp_path / "d.csv").write_bytes(raw)
    span = CSVDataReader([path], encoding="latin-1").span(path, 0, 3)
    with pytest.raises(MalformedRecordError, match="record 1.*cannot decode"):
        CSVDataReader([path]).read_span(path, 0, 3, span)
