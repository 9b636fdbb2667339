"""Unit tests for elasticdl.data: CSV/text/NumPy/Parquet readers and the registry."""

from __future__ import annotations

import csv
import io
import pickle
import random
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from elasticdl.common.reader_params import parse_reader_params
from elasticdl.data import (
    CSVDataReader,
    DataError,
    MalformedRecordError,
    Shard,
    TextDataReader,
    create_data_reader,
    register_data_reader,
)
from elasticdl.data import csv_reader as csv_reader_module
from elasticdl.data.csv_reader import build_line_index


def _write(path: Path, text: str) -> str:
    path.write_bytes(text.encode("utf-8"))
    return str(path)


def _python_csv(path: str, delimiter: str = ",") -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f, delimiter=delimiter))


def _random_csv(rng: random.Random, rows: int, newline: str = "\n") -> str:
    """Rows of 3 fields with quoting, embedded delimiters/quotes and non-ASCII text."""
    out = io.StringIO(newline="")
    writer = csv.writer(out, lineterminator=newline)
    words = ["plain", "with,comma", 'say "hi"', "ünïcödé", "", " spaced ", '12" pizza']
    for i in range(rows):
        writer.writerow([str(i), rng.choice(words), rng.choice(words) * rng.randint(0, 3)])
    return out.getvalue()


# --- CSV -------------------------------------------------------------------------------------


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
@pytest.mark.parametrize("block_size", [5, 64, 1 << 20])
def test_csv_ranges_match_python_csv(tmp_path: Path, newline: str, block_size: int) -> None:
    rng = random.Random(7)
    path = _write(tmp_path / "data.csv", _random_csv(rng, 300, newline))
    expected = _python_csv(path)
    reader = CSVDataReader([path], block_size=block_size)
    assert reader.create_shards() == [Shard(path, 0, 300)]
    assert reader.num_records() == 300
    assert reader.read(path, 0, 300) == expected
    for _ in range(50):
        start = rng.randint(0, 300)
        end = rng.randint(start, 300)
        assert reader.read(path, start, end) == expected[start:end]


def test_line_index_is_independent_of_block_size(tmp_path: Path) -> None:
    path = _write(tmp_path / "x.txt", "ab\r\n\ncd\r\nefg\nh\r\n\r\n\n")
    reference = build_line_index(path)
    assert reference.dtype == np.int64
    assert reference.tolist() == [0, 4, 5, 9, 13, 16]  # trailing blank lines dropped
    for block_size in (1, 2, 3, 7):
        assert build_line_index(path, block_size).tolist() == reference.tolist()


def test_csv_header(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.csv", "id,name\n1,x\n2,y\n")
    reader = create_data_reader(path, parse_reader_params("header=true"))
    assert isinstance(reader, CSVDataReader)
    assert reader.columns == ["id", "name"]
    assert reader.create_shards() == [Shard(path, 0, 2)]
    assert reader.read(path, 0, 2) == [["1", "x"], ["2", "y"]]
    assert create_data_reader(path).read(path, 0, 1) == [["id", "name"]]
    assert create_data_reader(path).columns is None  # type: ignore[attr-defined]


def test_csv_header_only_file_has_no_shard_and_headers_must_agree(tmp_path: Path) -> None:
    _write(tmp_path / "a.csv", "id,name\n1,x\n")
    _write(tmp_path / "b.csv", "id,name\n")
    reader = create_data_reader(str(tmp_path), {"header": "true"})
    assert [s.count for s in reader.create_shards()] == [1]
    _write(tmp_path / "c.csv", "id,other\n2,y\n")
    reader = create_data_reader(str(tmp_path), {"header": "true"})
    with pytest.raises(DataError, match=r"c\.csv.*header"):
        reader.create_shards()


@pytest.mark.parametrize(
    "text",
    ["1,a\r\n2,b\r\n3,c\r\n", "1,a\n2,b\n3,c", "1,a\n2,b\n3,c\n\n\r\n\n", "\ufeff1,a\n2,b\n3,c\n"],
    ids=["crlf", "no-final-newline", "trailing-blank-lines", "bom"],
)
def test_csv_line_endings(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path / "e.csv", text)
    reader = create_data_reader(path)
    assert reader.num_records() == 3
    assert reader.read(path, 0, 3) == [["1", "a"], ["2", "b"], ["3", "c"]]
    assert reader.read(path, 2, 3) == [["3", "c"]]


def test_malformed_row_names_file_and_index(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.csv", "1,a\n2,b\n3\n4,d\n\n5,e\n")
    reader = create_data_reader(path)
    assert reader.num_records() == 6
    assert reader.read(path, 0, 2) == [["1", "a"], ["2", "b"]]
    with pytest.raises(MalformedRecordError) as info:
        reader.read(path, 1, 4)
    err = info.value
    assert (err.path, err.record_index, err.reason) == (path, 2, "expected 2 fields, got 1")
    assert "bad.csv" in str(err) and "2" in str(err)
    assert pickle.loads(pickle.dumps(err)).record_index == 2
    with pytest.raises(MalformedRecordError) as info:  # a blank line inside the file
        reader.read(path, 3, 6)
    assert info.value.record_index == 4 and "got 0" in info.value.reason


def test_unterminated_quote_is_malformed_whatever_the_range(tmp_path: Path) -> None:
    path = _write(tmp_path / "q.csv", '1,a\n2,"b\n3,c\n')
    reader = create_data_reader(path)
    for start, end in [(1, 2), (1, 3), (0, 3)]:
        with pytest.raises(MalformedRecordError) as info:
            reader.read(path, start, end)
        assert info.value.record_index == 1 and "quoted" in info.value.reason
    assert reader.read(path, 2, 3) == [["3", "c"]]


def test_undecodable_bytes_name_the_record(tmp_path: Path) -> None:
    path = tmp_path / "u.csv"
    path.write_bytes(b"1,a\n2,\xff\n3,c\n")
    reader = create_data_reader(str(path))
    with pytest.raises(MalformedRecordError) as info:
        reader.read(str(path), 0, 3)
    assert info.value.record_index == 1
    latin = create_data_reader(str(path), {"encoding": "latin-1"})
    assert latin.read(str(path), 1, 2) == [["2", "\xff"]]


def test_separators_and_tsv(tmp_path: Path) -> None:
    tsv = _write(tmp_path / "t.tsv", "1\ta,b\n2\tc\n")
    assert create_data_reader(tsv).read(tsv, 0, 2) == [["1", "a,b"], ["2", "c"]]
    piped = _write(tmp_path / "p.csv", "1|a\n2|b\n")
    reader = create_data_reader(piped, parse_reader_params("sep=|"))
    assert reader.read(piped, 0, 2) == [["1", "a"], ["2", "b"]]
    reader = create_data_reader(tsv, parse_reader_params("sep=\\t"))
    assert reader.read(tsv, 1, 2) == [["2", "c"]]
    with pytest.raises(ValueError, match="sep"):
        create_data_reader(piped, {"sep": "||"})


def test_index_built_once_under_concurrency(tmp_path: Path, monkeypatch) -> None:
    path = _write(tmp_path / "c.csv", "".join(f"{i},x\n" for i in range(1000)))
    calls = []
    original = csv_reader_module.build_line_index

    def counting(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(csv_reader_module, "build_line_index", counting)
    reader = create_data_reader(path)
    results: list[list[list[str]]] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(reader.read(path, i, i + 10)))
        for i in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads)
    assert calls == [path]
    assert sorted(r[0][0] for r in results) == [str(i) for i in range(8)]


def test_csv_index_streams_blocks_with_bounded_memory(tmp_path: Path) -> None:
    line = b"12345," + b"x" * 200 + b"\n"
    lines = 100_000
    path = tmp_path / "big.csv"
    path.write_bytes(line * lines)  # ~20 MB
    size = path.stat().st_size
    block = 1 << 20

    tracemalloc.start()
    try:
        path.read_bytes()  # control: the measurement sees a whole-file load
        _, whole_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        reader = CSVDataReader([str(path)], block_size=block)
        assert reader.num_records() == lines
        _, index_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert whole_peak >= size
    # block buffer + per-block scratch + the int64 offsets (8 bytes per record, twice while
    # concatenating); a whole-file load would need > 20 MB.
    assert index_peak < 4 * block + 2 * 8 * (lines + 1) + (1 << 20), index_peak
    assert reader.read(str(path), lines - 1, lines) == [["12345", "x" * 200]]


# --- text ------------------------------------------------------------------------------------


def test_text_reader(tmp_path: Path) -> None:
    path = _write(tmp_path / "lines.txt", "first\r\n\n  third  \nlast,with,commas\n\n")
    reader = create_data_reader(path)
    assert isinstance(reader, TextDataReader)
    assert reader.num_records() == 4
    assert reader.read(path, 0, 4) == ["first", "", "  third  ", "last,with,commas"]
    assert reader.read(path, 3, 4) == ["last,with,commas"]
    with pytest.raises(ValueError, match="unknown text reader parameter"):
        create_data_reader(path, {"sep": ","})


def test_empty_text_file_has_no_shard(tmp_path: Path) -> None:
    _write(tmp_path / "a.text", "")
    _write(tmp_path / "b.text", "x\n")
    reader = create_data_reader(str(tmp_path))
    assert reader.create_shards() == [Shard(str(tmp_path / "b.text"), 0, 1)]


# --- directories and the registry --------------------------------------------------------------


def test_directory_dataset(tmp_path: Path) -> None:
    for name, rows in [("b.csv", 3), ("a.csv", 2), ("c.csv", 4)]:
        _write(tmp_path / name, "".join(f"{name},{i}\n" for i in range(rows)))
    _write(tmp_path / ".hidden.csv", "ignored\n")
    _write(tmp_path / "a.csv.idx", "sidecar")
    _write(tmp_path / "_SUCCESS", "")
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub" / "d.csv", "nested,0\n")
    reader = create_data_reader(str(tmp_path))
    shards = reader.create_shards()
    assert shards == [
        Shard(str(tmp_path / "a.csv"), 0, 2),
        Shard(str(tmp_path / "b.csv"), 0, 3),
        Shard(str(tmp_path / "c.csv"), 0, 4),
    ]
    assert reader.num_records() == 9
    assert reader.read(shards[1].name, 1, 3) == [["b.csv", "1"], ["b.csv", "2"]]
    with pytest.raises(DataError, match="not a file of this dataset"):
        reader.read(str(tmp_path / "sub" / "d.csv"), 0, 1)


def test_mixed_formats_rejected(tmp_path: Path) -> None:
    _write(tmp_path / "a.csv", "1,2\n")
    _write(tmp_path / "b.txt", "x\n")
    with pytest.raises(DataError, match=str(tmp_path)):
        create_data_reader(str(tmp_path))


def test_missing_unknown_and_empty_paths(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match="nope"):
        create_data_reader(str(missing))
    unknown = _write(tmp_path / "x.json", "{}")
    with pytest.raises(DataError, match=r"x\.json"):
        create_data_reader(unknown)
    empty = tmp_path / "empty"
    empty.mkdir()
    _write(empty / ".hidden", "x")
    with pytest.raises(DataError, match="empty"):
        create_data_reader(str(empty))
    with pytest.raises(DataError, match="unknown data format"):
        create_data_reader(unknown, {"format": "nosuch"})


def test_format_param_and_custom_registration(tmp_path: Path) -> None:
    path = _write(tmp_path / "rows.data", "1,2\n3,4\n")
    assert create_data_reader(path, {"format": "csv"}).read(path, 1, 2) == [["3", "4"]]
    register_data_reader("upper", lambda files, params: TextDataReader(files), [".upper"])
    upper = _write(tmp_path / "u.upper", "A\nB\n")
    assert create_data_reader(upper).read(upper, 0, 2) == ["A", "B"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sep=|;header=true", {"sep": "|", "header": "true"}),
        ("", {}),
        (None, {}),
        (" header = true ; ; expr=a=b;", {"header": " true ", "expr": "a=b"}),
        ("sep= ", {"sep": " "}),
    ],
)
def test_parse_reader_params(text: str | None, expected: dict[str, str]) -> None:
    assert parse_reader_params(text) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["sep=|;header", "=x", "a=1;a=2"])
def test_parse_reader_params_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="header|=x|twice"):
        parse_reader_params(text)


def test_invalid_params(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.csv", "1\n")
    with pytest.raises(ValueError, match="boolean"):
        create_data_reader(path, {"header": "maybe"})
    with pytest.raises(ValueError, match="unknown csv reader parameter"):
        create_data_reader(path, {"delimiter": ","})
    with pytest.raises(ValueError, match="encoding"):
        create_data_reader(path, {"encoding": "utf-16"})


# --- NumPy ----------------------------------------------------------------------------------


def test_npy_rows(tmp_path: Path) -> None:
    array = np.arange(60, dtype=np.float32).reshape(20, 3)
    np.save(tmp_path / "a.npy", array)
    np.save(tmp_path / "b.npy", np.arange(5, dtype=np.int64).reshape(5, 1))
    reader = create_data_reader(str(tmp_path))
    path = str(tmp_path / "a.npy")
    assert reader.create_shards() == [Shard(path, 0, 20), Shard(str(tmp_path / "b.npy"), 0, 5)]
    rows = reader.read(path, 4, 9)
    assert len(rows) == 5
    np.testing.assert_array_equal(np.stack(rows), array[4:9])
    assert not rows[0].flags.writeable  # a view of the read-only mapping


def test_npz_rows_and_mismatched_first_dims(tmp_path: Path) -> None:
    x = np.arange(24).reshape(8, 3)
    y = np.arange(8) * 10
    np.savez_compressed(tmp_path / "a.npz", x=x, y=y)
    path = str(tmp_path / "a.npz")
    reader = create_data_reader(path)
    assert reader.num_records() == 8
    rows = reader.read(path, 2, 5)
    assert [sorted(r) for r in rows] == [["x", "y"]] * 3
    for i, row in enumerate(rows, start=2):
        np.testing.assert_array_equal(row["x"], x[i])
        assert row["y"] == y[i]
    np.savez(tmp_path / "bad.npz", x=np.zeros((4, 2)), y=np.zeros(3))
    with pytest.raises(DataError, match=r"bad\.npz.*x: 4, y: 3"):
        create_data_reader(str(tmp_path / "bad.npz")).create_shards()


def test_numpy_kinds_not_mixed(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.zeros((2, 2)))
    np.savez(tmp_path / "b.npz", x=np.zeros(2))
    with pytest.raises(DataError, match="mixes"):
        create_data_reader(str(tmp_path))


# --- Parquet --------------------------------------------------------------------------------


def test_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"id": list(range(50)), "name": [f"n{i}" for i in range(50)]})
    path = str(tmp_path / "t.parquet")
    pq.write_table(table, path, row_group_size=7)
    reader = create_data_reader(path)
    assert reader.create_shards() == [Shard(path, 0, 50)]
    expected = table.to_pylist()
    for start, end in [(0, 50), (0, 7), (6, 8), (13, 29), (49, 50)]:
        assert reader.read(path, start, end) == expected[start:end]
    narrow = create_data_reader(path, {"columns": "name"})
    assert narrow.read(path, 8, 10) == [{"name": "n8"}, {"name": "n9"}]
    with pytest.raises(DataError, match="nosuch"):
        create_data_reader(path, {"columns": "nosuch"}).create_shards()


def test_parquet_without_pyarrow_is_a_data_error(tmp_path: Path, monkeypatch) -> None:
    path = _write(tmp_path / "t.parquet", "not really parquet")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"t\.parquet.*pyarrow"):
        create_data_reader(path).create_shards()


def test_corrupt_files_are_data_errors(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    for name in ("x.parquet", "x.npy", "x.npz"):
        path = _write(tmp_path / name, "garbage")
        with pytest.raises(DataError, match=name.replace(".", r"\.")):
            create_data_reader(path).create_shards()


# --- common behaviour -----------------------------------------------------------------------


def _one_file_of_each(tmp_path: Path) -> list[str]:
    paths = [_write(tmp_path / "a.csv", "1,2\n3,4\n5,6\n"), _write(tmp_path / "a.txt", "a\nb\nc\n")]
    np.save(tmp_path / "a.npy", np.zeros((3, 2)))
    np.savez(tmp_path / "a.npz", x=np.zeros(3))
    return [*paths, str(tmp_path / "a.npy"), str(tmp_path / "a.npz")]


@pytest.mark.parametrize(("start", "end"), [(-1, 2), (0, 4), (2, 1)])
def test_bounds_errors(tmp_path: Path, start: int, end: int) -> None:
    for path in _one_file_of_each(tmp_path):
        reader = create_data_reader(path)
        with pytest.raises(ValueError, match=Path(path).name.replace(".", r"\.")):
            reader.read(path, start, end)
        assert reader.read(path, 3, 3) == []


def test_readers_pickle_without_state(tmp_path: Path) -> None:
    for path in _one_file_of_each(tmp_path):
        reader = create_data_reader(path)
        before = reader.read(path, 1, 3)
        clone = pickle.loads(pickle.dumps(reader))
        after = clone.read(path, 1, 3)
        assert len(after) == 2
        assert repr(after) == repr(before)


def test_data_package_does_not_import_torch() -> None:
    code = "import sys, elasticdl.data, elasticdl.data.registry; assert 'torch' not in sys.modules"
    repo_root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root)
