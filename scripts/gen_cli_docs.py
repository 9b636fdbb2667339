"""Write docs/cli.md from the JobSpec fields (the one place flags are defined).

Run: python scripts/gen_cli_docs.py > docs/cli.md   (a test checks it is current)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elasticdl.common.job_spec import cli_fields  # noqa: E402

TITLES = {"job": "Job", "model": "Model module", "data": "Data", "training": "Training",
          "distribution": "Distribution", "cluster": "Cluster (Kubernetes)"}


def render() -> str:
    out = ["# `elasticdl` command reference", "",
           "Generated from `elasticdl/common/job_spec.py` by `scripts/gen_cli_docs.py`; "
           "`elasticdl train --help` prints the same.", "",
           "Commands: `train`, `evaluate`, `predict` take the flags below; "
           "`status JOB`, `logs JOB [--replica=worker-1] [--follow]`, `stop JOB` manage "
           "running jobs; `zoo init|build|push` package a model zoo as an image.", "",
           "Exit codes: 0 success, 1 the job failed, 2 bad flags / model module / data "
           "found before the job started.", ""]
    groups: dict[str, list] = {}
    for f in cli_fields():
        groups.setdefault(f.metadata["group"], []).append(f)
    for group, fields in groups.items():
        out += [f"## {TITLES.get(group, group)}", "", "| flag | default | meaning |",
                "| --- | --- | --- |"]
        for f in fields:
            default = repr(f.default) if f.default != "" else ""
            out.append(f"| `--{f.name}` | `{default}` | {f.metadata['help']} |"
                       if default else f"| `--{f.name}` | | {f.metadata['help']} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
