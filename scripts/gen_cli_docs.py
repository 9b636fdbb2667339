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
           "found before the job started, 128 + N stopped by signal N (130 Ctrl-C, "
           "143 SIGTERM, 129 SIGHUP).", "",
           "## Stopping a job", "",
           "Ctrl-C, SIGTERM (e.g. from `timeout`) and SIGHUP (a closed terminal) to "
           "`elasticdl train|evaluate|predict` stop the job: a Local job in the client's "
           "process; a `--cluster=local` job's master, PS and workers, which run in their "
           "own sessions, are stopped by the client (the master stops its replicas; any "
           "still running after it are killed) and `job_report.json` says `stopped`. "
           "A client killed with SIGKILL cannot clean up: the job keeps running; "
           "`elasticdl status JOB` shows it and `elasticdl stop JOB` ends it (and every "
           "process it started). A Kubernetes job runs on in the cluster whatever "
           "happens to the client; `elasticdl stop JOB` ends it.", "",
           "## Final model", "",
           "A training job writes `model.pt` (the model's own state dict, loadable into the "
           "model class without elasticdl) to `--output`. With `--export_torchscript` it "
           "also tries `model_scripted.pt`; a model TorchScript cannot compile (many "
           "Hugging Face `transformers` models: `OSError: Failed to get source`) gets a "
           "warning naming the error, and the job still succeeds with `model.pt`.", ""]
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
