"""Dataset readers: shards of files and the records in them (never imports torch).

Use :func:`create_data_reader` to get the reader for a data file or directory; see
:mod:`elasticdl.data.api` for the contract and :mod:`elasticdl.data.registry` for formats and
parameters.
"""

from elasticdl.data.api import DataError, DataReader, FileDataReader, MalformedRecordError, Shard
from elasticdl.data.csv_reader import CSVDataReader, TextDataReader
from elasticdl.data.numpy_reader import NumPyDataReader
from elasticdl.data.parquet_reader import ParquetDataReader
from elasticdl.data.registry import (
    ReaderFactory,
    create_data_reader,
    dataset_files,
    register_data_reader,
)

__all__ = [
    "CSVDataReader",
    "DataError",
    "DataReader",
    "FileDataReader",
    "MalformedRecordError",
    "NumPyDataReader",
    "ParquetDataReader",
    "ReaderFactory",
    "Shard",
    "TextDataReader",
    "create_data_reader",
    "dataset_files",
    "register_data_reader",
]
