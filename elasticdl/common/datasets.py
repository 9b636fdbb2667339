"""The readers of a job's datasets, one per task type."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from elasticdl.common.enums import JobType
from elasticdl.common.task import TaskType
from elasticdl.data.api import DataError, DataReader
from elasticdl.data.registry import create_data_reader


def create_readers(spec: Any, custom_reader: Optional[Callable[..., DataReader]] = None
                   ) -> dict[TaskType, DataReader]:
    """Readers for the training, validation and prediction data a job names.

    ``custom_reader(path, params)`` from the model module replaces the
    built-in readers. Raises DataError naming an unreadable path.
    """
    params = spec.reader_params
    readers: dict[TaskType, DataReader] = {}
    for typ, path in ((TaskType.TRAINING, spec.training_data),
                      (TaskType.EVALUATION, spec.validation_data),
                      (TaskType.PREDICTION, spec.prediction_data)):
        if not path:
            continue
        if custom_reader is not None:
            reader = custom_reader(path, params)
            if not isinstance(reader, DataReader):
                raise DataError(f"custom_data_reader returned {type(reader).__name__}, not a "
                                "DataReader")
        else:
            reader = create_data_reader(path, params)
        readers[typ] = reader
    return readers


def shards_for(readers: dict[TaskType, DataReader], spec: Any) -> dict[str, Any]:
    """The shards each TaskManager argument needs for this job type."""
    def shards(typ: TaskType) -> list:
        return list(readers[typ].create_shards()) if typ in readers else []

    if spec.job_type == JobType.TRAIN:
        return {"training_shards": shards(TaskType.TRAINING),
                "evaluation_shards": shards(TaskType.EVALUATION)}
    if spec.job_type == JobType.EVALUATE:
        return {"evaluation_shards": shards(TaskType.EVALUATION)}
    return {"prediction_shards": shards(TaskType.PREDICTION)}
