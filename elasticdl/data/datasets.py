"""The readers of a job's datasets, one per task type."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from elasticdl.common.enums import JobType
from elasticdl.common.task import TaskType
from elasticdl.data.api import DataError, DataReader
from elasticdl.data.fs import configure_from_spec
from elasticdl.data.registry import create_data_reader

_TYPES = {"training": TaskType.TRAINING, "evaluation": TaskType.EVALUATION,
          "prediction": TaskType.PREDICTION}


def create_readers(spec: Any, custom_reader: Optional[Callable[..., DataReader]] = None,
                   model_spec: Optional[Any] = None) -> dict[TaskType, DataReader]:
    """Readers for the training, validation and prediction data a job names.

    ``custom_reader(path, params)`` from the model module replaces the
    built-in readers; a module's ``dataset(path, mode)`` (``model_spec.dataset``)
    replaces both: its datasets are read through a torch DataLoader
    (:mod:`elasticdl.data.torch_dataset`; this imports torch). Raises DataError
    naming an unreadable path.
    """
    configure_from_spec(spec)    # --data_endpoint, for this process and its children
    if model_spec is not None and getattr(model_spec, "dataset", None) is not None:
        from elasticdl.data.dataset_source import data_flags
        from elasticdl.data.torch_dataset import dataset_readers, pin_memory_default

        made = dataset_readers(model_spec, data_flags(spec), spec.data_loader_workers,
                               pin_memory_default(spec.device), spec.data_loader_timeout_s)
        return {_TYPES[mode]: reader for mode, reader in made.items()}
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


def master_readers(spec: Any, probe_command: Sequence[str], defined: bool = False
                   ) -> dict[TaskType, DataReader]:
    """The master's readers of a model module's ``dataset(path, mode)``, sized by a
    probe subprocess, ``probe_command`` (the master never imports torch); None when the
    module's source defines no ``dataset`` (:mod:`elasticdl.data.dataset_source`) and ``defined`` is
    False: ``{}``."""
    from elasticdl.data import dataset_source as ds

    configure_from_spec(spec)    # the probe subprocess inherits --data_endpoint

    module_name = spec.model_def.rsplit(".", 1)[0]
    if not (defined or ds.module_defines(spec.model_zoo, module_name, ds.DATASET_FN)):
        return {}
    shards = ds.dataset_shards(spec, ds.probe_sizes(spec, probe_command))
    return {_TYPES[mode]: reader for mode, reader in shards.items()}
