"""``python -m elasticdl.api.dataset_probe --job_spec=JSON``: the lengths of a model
module's ``dataset(path, mode)`` for the job's data flags, printed as one JSON line.

Run by the master (:func:`elasticdl.data.dataset_source.probe_sizes`, with :func:`command`),
which never imports torch itself: importing this module imports nothing of torch either.
Exit 0 with ``{"training": N, ...}``; exit 1 with
``{"error": "..."}`` naming the module, the path and what went wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional


def command() -> list[str]:
    """The probe's argv without its ``--job_spec``: this module run by this interpreter."""
    return [sys.executable, "-m", __name__]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="elasticdl.api.dataset_probe")
    p.add_argument("--job_spec", required=True)
    a = p.parse_args(argv)
    from elasticdl.api.model_spec import ModelSpecError, load_from_job_spec
    from elasticdl.common.job_spec import JobSpec
    from elasticdl.data.api import DataError
    from elasticdl.data.dataset_source import data_flags
    from elasticdl.data.torch_dataset import dataset_readers

    spec = JobSpec.from_json(a.job_spec)
    try:
        model_spec = load_from_job_spec(spec)
        if model_spec.dataset is None:
            raise DataError(f"{model_spec.module_path} defines no dataset(path, mode)")
        readers = dataset_readers(model_spec, data_flags(spec), 0, False)
    except (DataError, ModelSpecError) as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 1
    print(json.dumps({mode: r.size for mode, r in readers.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
