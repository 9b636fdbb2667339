"""A restarted master reuses the CSV/text line index kept in the job directory
(issue 20: restore without re-reading the dataset)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elasticdl.data import csv_reader as csv_reader_module
from elasticdl.data.csv_reader import INDEX_CACHE_ENV, CSVDataReader, TextDataReader


def test_index_is_kept_and_reused_without_reading_the_file(tmp_path: Path, monkeypatch) -> None:
    data = tmp_path / "d.csv"
    data.write_text("h1,h2\n" + "".join(f"{i},{i * 2}\n" for i in range(1000)))
    cache = tmp_path / "idx"
    first = CSVDataReader([str(data)], header=True, index_cache_dir=str(cache))
    assert first.create_shards() == [(str(data), 0, 1000)]
    assert len(os.listdir(cache)) == 1
    # a new reader (a restarted master) never indexes the file again
    calls = []
    real = csv_reader_module.build_line_index
    monkeypatch.setattr(csv_reader_module, "build_line_index",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    again = CSVDataReader([str(data)], header=True, index_cache_dir=str(cache))
    assert again.create_shards() == first.create_shards() and not calls
    assert again.read(str(data), 998, 1000) == [["998", "1996"], ["999", "1998"]]
    # a changed file (size/mtime) is indexed afresh
    with open(data, "a") as f:
        f.write("1000,2000\n")
    changed = CSVDataReader([str(data)], header=True, index_cache_dir=str(cache))
    assert changed.create_shards() == [(str(data), 0, 1001)] and len(calls) == 1


@pytest.mark.parametrize("writable", [True, False])
def test_cache_dir_from_the_environment_and_an_unwritable_one_only_warns(
        tmp_path: Path, monkeypatch, writable: bool) -> None:
    data = tmp_path / "t.txt"
    data.write_text("a\nb\nc\n")
    cache = tmp_path / "idx"
    if not writable:
        cache.write_text("a file, not a directory")
    monkeypatch.setenv(INDEX_CACHE_ENV, str(cache))
    reader = TextDataReader([str(data)])
    assert reader.create_shards() == [(str(data), 0, 3)]
    assert reader.read(str(data), 1, 3) == ["b", "c"]
    assert (len(os.listdir(cache)) == 1) if writable else cache.is_file()
