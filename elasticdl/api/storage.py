"""Reading data where it lives, for a model module's ``dataset(path, mode)``.

A module's ``dataset`` gets ``--training_data`` (and the others) as given: a local path or a
URL (``s3://bucket/prefix``, ``gs://``, ``hdfs://``; see docs/data.md). These functions read
either kind the way the built-in readers do: the job's ``--data_endpoint`` and the credentials
of the environment, transient errors retried within a bounded budget, permanent ones a
:class:`DataError` naming the URL::

    from elasticdl.api.storage import data_files, open_input

    def dataset(path, mode):
        tables = []
        for f in data_files(path):          # one listing of the prefix
            with open_input(f, exact=True) as fp:
                tables.append(pyarrow.parquet.read_table(fp))
        ...

``open_input`` returns a seekable file whose reads are ranged GETs; wrap its use in
:func:`retrying` to retry a whole read on a transient error.
"""

from elasticdl.data.api import DataError
from elasticdl.data.fs import (
    RemoteFile,
    info,
    is_url,
    open_input,
    read_bytes,
    read_range,
    retrying,
)
from elasticdl.data.registry import dataset_files as data_files

__all__ = ["DataError", "RemoteFile", "data_files", "info", "is_url", "open_input",
           "read_bytes", "read_range", "retrying"]
