"""Parsing of the small key=value flag languages: resources, envs, volumes, params.

Every parser raises ``ValueError`` with a message that says what is wrong; the
caller prefixes it with the flag name.
"""

from __future__ import annotations

import re

_QUANTITY = re.compile(r"^([0-9]+(\.[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_GPU_VENDORS = {"gpu": "nvidia.com/gpu"}
_KNOWN_RESOURCES = {"cpu", "memory", "gpu", "ephemeral-storage", "ephemeral_storage"}


def parse_kv_list(text: str, item_sep: str = ",", kv_sep: str = "=") -> dict[str, str]:
    """Parse ``"a=1,b=2"`` into ``{"a": "1", "b": "2"}``; empty text gives ``{}``."""
    out: dict[str, str] = {}
    if not text:
        return out
    for piece in text.split(item_sep):
        piece = piece.strip()
        if not piece:
            continue
        if kv_sep not in piece:
            raise ValueError(f"expected key{kv_sep}value, got {piece!r}")
        key, value = piece.split(kv_sep, 1)
        key, value = key.strip(), value.strip()
        if not key:
            raise ValueError(f"empty key in {piece!r}")
        if key in out:
            raise ValueError(f"key {key!r} given twice")
        out[key] = value
    return out


def parse_resources(text: str) -> dict[str, str]:
    """Parse ``"cpu=2,memory=4096Mi,gpu=1"`` into Kubernetes resource quantities.

    ``gpu`` maps to ``nvidia.com/gpu``; a fully qualified vendor resource
    (``amd.com/gpu=1``) passes through. Raises ValueError on an unknown
    resource name or a value that is not a Kubernetes quantity.
    """
    resources: dict[str, str] = {}
    for key, value in parse_kv_list(text).items():
        if key not in _KNOWN_RESOURCES and "/" not in key:
            raise ValueError(
                f"unknown resource {key!r} (use cpu, memory, gpu, ephemeral-storage "
                "or a vendor resource such as nvidia.com/gpu)"
            )
        if not _QUANTITY.match(value):
            raise ValueError(f"{key}={value!r} is not a quantity (examples: 2, 0.5, 500m, 4096Mi)")
        if (key == "gpu" or key.endswith("/gpu")) and not value.isdigit():
            raise ValueError(f"{key}={value!r}: GPUs are counted in whole numbers")
        name = _GPU_VENDORS.get(key, key).replace("ephemeral_storage", "ephemeral-storage")
        resources[name] = value
    return resources


def cpu_threads(quantity: str) -> int:
    """The compute threads a replica of ``quantity`` CPUs runs (``"2"``: 2, ``"500m"``
    or ``"1.5"``: 1); 0 for no quantity."""
    m = _QUANTITY.match(quantity or "")
    if not m:
        return 0
    cpus = float(m.group(1)) / (1000 if m.group(3) == "m" else 1)
    return max(1, int(cpus))


def thread_env(env: dict[str, str], requests: dict[str, str],
               limits: dict[str, str]) -> dict[str, str]:
    """``env`` with ``OMP_NUM_THREADS`` set from the replica's CPUs (its limit, else
    its request) unless ``env`` sets it: torch otherwise runs a thread per core of the
    machine in every replica, and replicas sharing cores (a Kubernetes node, every
    ``--cluster=local`` job) spin against each other."""
    threads = cpu_threads(limits.get("cpu", "") or requests.get("cpu", ""))
    if threads and "OMP_NUM_THREADS" not in env:
        return {**env, "OMP_NUM_THREADS": str(threads)}
    return env


def parse_envs(text: str) -> dict[str, str]:
    """Parse ``--envs="A=1,B=two"``."""
    envs = parse_kv_list(text)
    for key in envs:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise ValueError(f"{key!r} is not a valid environment variable name")
    return envs


def parse_volumes(text: str) -> list[dict[str, str]]:
    """Parse ``--volume="host_path=/d,mount_path=/data;claim_name=c,mount_path=/m"``.

    Each volume needs ``mount_path`` and exactly one of ``host_path`` or
    ``claim_name``; ``type`` and ``sub_path`` are optional.
    """
    volumes: list[dict[str, str]] = []
    if not text:
        return volumes
    for spec in text.split(";"):
        if not spec.strip():
            continue
        vol = parse_kv_list(spec)
        unknown = set(vol) - {"host_path", "claim_name", "mount_path", "type", "sub_path"}
        if unknown:
            raise ValueError(f"unknown volume key(s) {sorted(unknown)} in {spec!r}")
        if "mount_path" not in vol:
            raise ValueError(f"volume {spec!r} has no mount_path")
        if ("host_path" in vol) == ("claim_name" in vol):
            raise ValueError(f"volume {spec!r} needs exactly one of host_path or claim_name")
        volumes.append(vol)
    return volumes


def parse_params(text: str) -> dict[str, object]:
    """Parse ``--model_params="hidden=64;lr=0.1;name=x;flag=true"`` (no eval).

    Values become int, float or bool when they read as one, else stay str.
    """
    out: dict[str, object] = {}
    for key, raw in parse_kv_list(text, item_sep=";").items():
        out[key] = _scalar(raw)
    return out


def _scalar(raw: str) -> object:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    return raw
