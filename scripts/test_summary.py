"""One closing line for `make test`: the summaries of the pytest runs it made, added up.

`make test` runs the real-cluster tier beside the rest of the suite (its control plane
and its jobs mostly wait; the rest mostly computes), each into a log. This reads the
closing summary line of each log (``== 12 passed, 1 skipped in 3.2s ==`` or its ``-q``
form) and prints ``total: N passed, N failed, N skipped`` as the last line. A log with no
summary line (a run that crashed or was killed) counts as a failure and is named.

    python scripts/test_summary.py LOG [LOG ...]
"""

from __future__ import annotations

import re
import sys

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
_SUMMARY = re.compile(r"^=*\s*(no tests ran|\d+ (passed|failed|skipped|errors?|xfailed|"
                      r"xpassed|deselected)\b.*) in [\d.]+s")


def summary(path: str) -> dict[str, int] | None:
    """The counts of the last summary line of ``path``; None when it has none."""
    found = None
    try:
        f = open(path, encoding="utf-8", errors="replace")
    except OSError:
        return None
    with f:
        for line in f:
            line = line.strip()
            if _SUMMARY.match(line):
                found = {k.rstrip("s") if k.startswith("error") else k: int(n)
                         for n, k in _COUNT.findall(line)}
    return found


def main(paths: list[str]) -> int:
    total = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    missing = []
    for path in paths:
        counts = summary(path)
        if counts is None:
            missing.append(path)
            continue
        for k in total:
            total[k] += counts.get(k, 0)
    for path in missing:
        print(f"{path}: no pytest summary line (the run crashed or was killed)")
    failed = total["failed"] + total["error"] + len(missing)
    print(f"total: {total['passed']} passed, {failed} failed, {total['skipped']} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
