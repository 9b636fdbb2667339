"""The job's kinds as enums: which strategy, which job type, which cluster.

They are ``str`` enums whose ``str()`` and format are their value, so the
JobSpec's JSON, flags, logs and the job report keep the plain names users
type (``--distribution_strategy=AllreduceStrategy``).
"""

from __future__ import annotations

import enum


class _StrEnum(str, enum.Enum):
    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]


class Strategy(_StrEnum):
    LOCAL = "Local"
    PS = "ParameterServerStrategy"
    ALLREDUCE = "AllreduceStrategy"


class JobType(_StrEnum):
    TRAIN = "train"
    EVALUATE = "evaluate"
    PREDICT = "predict"


class ClusterKind(_StrEnum):
    LOCAL = "local"
    K8S = "k8s"
