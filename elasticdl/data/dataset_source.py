"""How the master shards a model module's ``dataset(path, mode)`` without importing torch.

The master needs one number per dataset: ``len(dataset(path, mode))``. Calling the
module would import torch (and whatever the module imports, e.g. ``transformers``)
into the master, which never imports torch. So:

1. :func:`module_defines` reads the model module's source (``ast``, no import) to see
   whether it defines ``dataset`` at top level (a ``def``, an assignment or an import of
   that name). Only such jobs pay for step 2.
2. :func:`probe_sizes` runs the probe command it is given in a subprocess (the master
   passes ``python -m elasticdl.api.dataset_probe``, :func:`elasticdl.api.dataset_probe.command`)
   (same interpreter, same image and volumes as the workers, so it sees the data the
   workers will read): it loads the module, calls ``dataset(path, mode)`` for each data
   flag and prints the lengths as JSON. Its failure becomes a :class:`DataError` with
   the probe's last error lines.

The sizes become :class:`DatasetShards` readers: one shard per dataset, named by the
flag's value. A Local job calls ``dataset`` in process instead (it imports torch
anyway). The probe runs once per master start (a restored master probes again: a
dataset whose length changed is reported by the workers' range check).
"""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from elasticdl.data.api import DataError, DataReader, Shard

logger = logging.getLogger(__name__)

DATASET_FN = "dataset"
"""The name of the optional dataset factory in a model module."""
PROBE_TIMEOUT_S = 900.0
_ERROR_TAIL = 20   # lines of the probe's stderr quoted in its error


class DatasetShards(DataReader):
    """The master's view of a module's dataset: its name and size, nothing to read."""

    def __init__(self, path: str, size: int):
        self.path = path
        self.size = int(size)

    def create_shards(self) -> list[Shard]:
        return [Shard(self.path, 0, self.size)] if self.size else []

    def read(self, name: str, start: int, end: int) -> list[Any]:
        raise DataError(f"{name}: the master does not read a model module's dataset; "
                        "workers load it")


def module_file(model_zoo: str, module_name: str) -> Optional[str]:
    """The source file of ``module_name`` under ``model_zoo`` (None when not found)."""
    base = os.path.join(os.path.abspath(model_zoo), *module_name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def module_defines(model_zoo: str, module_name: str, name: str = DATASET_FN) -> bool:
    """Whether the module's source binds ``name`` at top level (no import of the module).

    An unreadable or unparsable source counts as not defining it (the module's own
    loading reports that later, with its error).
    """
    path = module_file(model_zoo, module_name)
    if path is None:
        return False
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                return True
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) == name:
                    return True
    return False


def data_flags(spec: Any) -> dict[str, tuple[str, str]]:
    """``{task kind: (path, mode)}`` of the data flags a job sets, task kinds being
    ``training``, ``evaluation`` and ``prediction`` (also ``feed``'s modes)."""
    out = {}
    for mode, path in (("training", spec.training_data), ("evaluation", spec.validation_data),
                       ("prediction", spec.prediction_data)):
        if path:
            out[mode] = (path, mode)
    return out


def probe_sizes(spec: Any, probe_command: Sequence[str],
                timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, int]:
    """``{mode: len(dataset(path, mode))}`` for the job's data flags, from a subprocess:
    ``probe_command`` (the probe's argv, :func:`elasticdl.api.dataset_probe.command`) with
    ``--job_spec JSON`` appended.

    Raises:
        DataError: the probe failed (the module's ``dataset`` raised, returned no
            map-style dataset, or the probe timed out), with its error lines.
    """
    cmd = [*probe_command, "--job_spec", spec.to_json()]
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    logger.info("dataset: probing the size of %s's dataset(path, mode) in a subprocess",
                spec.model_def)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise DataError(f"dataset(path, mode) of {spec.model_def}: measuring its length "
                        f"took more than {timeout_s:.0f} s") from None
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    sizes = json.loads(lines[-1]) if lines else {}
    if "error" in sizes:
        raise DataError(sizes["error"])
    if r.returncode != 0 or not lines:
        tail = "\n".join(r.stderr.strip().splitlines()[-_ERROR_TAIL:])
        raise DataError(f"dataset(path, mode) of {spec.model_def} cannot be sharded "
                        f"(probe exit {r.returncode}):\n{tail}")
    return {str(k): int(v) for k, v in sizes.items()}


def dataset_shards(spec: Any, sizes: Mapping[str, int]) -> dict[str, DatasetShards]:
    """``{mode: DatasetShards}`` from the probed sizes."""
    return {mode: DatasetShards(path, sizes[mode]) for mode, (path, _) in data_flags(spec).items()}
