"""Fuzz every RPC of the master and the PS for a while (issue 12).

Random and mutated messages (oversize and negative fields, wrong dtypes and
shapes, truncated and reordered chunk streams, undecodable bytes) with the job
token, garbage from a stranger without it, and a legitimate worker training at
the same time; see tests/integration/fuzz_harness.py for what counts as a crash.

Run: python benchmarks/fuzz_rpc.py --seconds 300 [--seed 0] [--smoke]
Prints the figures as JSON; exits 1 on any crash, internal error, state change by
a refused request, or a legitimate step that failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.integration.fuzz_harness import run_fuzz  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="seconds: fuzz for 3 s")
    args = p.parse_args()
    if args.smoke:
        args.seconds = 3.0
    logging.basicConfig(level=logging.CRITICAL)  # refusals are the point; keep it quiet
    report = run_fuzz(args.seconds, args.seed)
    summary = report.summary()
    summary["per_method"] = dict(sorted(report.per_method.items()))
    print(json.dumps(summary, indent=1))
    bad = (report.crashes or report.internal or report.state_changes_on_refusal
           or report.legit_errors)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
