"""The README fits a screen or five, every relative link in the docs resolves, and
docs/benchmarks.md keeps one current row per benchmark."""

from __future__ import annotations

import collections
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
BENCHMARKS_MD = os.path.join(ROOT, "docs", "benchmarks.md")
MAX_README_LINES = 250

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _markdown_files() -> list[str]:
    return [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def _prose_lines(path: str) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    out, fenced = [], False
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if _FENCE.match(line):
                fenced = not fenced
                continue
            if not fenced:
                out.append((n, line.rstrip("\n")))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: links and emphasis reduced to their text,
    lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: str) -> set[str]:
    seen: collections.Counter[str] = collections.Counter()
    anchors = set()
    for _, line in _prose_lines(path):
        m = _HEADING.match(line)
        if not m:
            continue
        base = _slug(m.group(2))
        anchors.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return anchors


def _relative_links(path: str) -> list[tuple[int, str]]:
    links = []
    for n, line in _prose_lines(path):
        for m in _LINK.finditer(_INLINE_CODE.sub("", line)):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            links.append((n, target))
    return links


def test_readme_fits():
    with open(README, encoding="utf-8") as f:
        n = sum(1 for _ in f)
    assert n <= MAX_README_LINES, (
        f"README.md has {n} lines (at most {MAX_README_LINES}): move reference material "
        "to docs/ (benchmarks.md, limits.md, the page of its area)"
    )


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(path):
    broken = []
    for n, target in _relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = path
        if file_part:
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part))
        where = f"{os.path.relpath(path, ROOT)}:{n}: {target}"
        if not os.path.exists(dest):
            broken.append(f"{where} (no such file)")
        elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
            broken.append(f"{where} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _cells(row: str) -> list[str]:
    """A table row's cells; a `|` inside backticks does not split."""
    cells, cur, code = [], "", False
    for ch in row.strip().strip("|"):
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*cells, cur.strip()]


def _benchmark_rows() -> list[list[str]]:
    """The cells of every row of the tables whose header starts with `| benchmark |`."""
    rows, in_table = [], False
    for _, line in _prose_lines(BENCHMARKS_MD):
        if not line.startswith("|"):
            in_table = False
            continue
        cells = _cells(line)
        if cells and cells[0] == "benchmark":
            in_table = True
        elif in_table and not set(cells[0]) <= set("-: "):
            rows.append(cells)
    return rows


def test_benchmarks_one_row_per_benchmark():
    rows = _benchmark_rows()
    assert rows, "docs/benchmarks.md has no benchmark table"
    names = [r[0] for r in rows]
    duplicates = sorted(n for n, c in collections.Counter(names).items() if c > 1)
    assert not duplicates, f"more than one row for {duplicates}: keep the newest figure only"


def test_benchmark_rows_name_a_date_and_an_existing_script():
    for cells in _benchmark_rows():
        name, date, command = cells[0], cells[4], cells[6]
        assert re.match(r"^20\d\d-\d\d-\d\d\b", date), f"{name}: no date in {date!r}"
        scripts = re.findall(r"benchmarks/(\w+\.py)", command)
        assert scripts, f"{name}: no benchmarks/*.py in {command!r}"
        for script in scripts:
            assert os.path.exists(os.path.join(ROOT, "benchmarks", script)), (name, script)
