"""Cost of observability on the master: get_task + report_task_result round trips
of training tasks (each report carrying a loss and a learning rate) from 4 client
processes, against a master whose job core has the TensorBoard writer and the
Prometheus endpoint attached (scraped every second meanwhile) and one without;
both masters in this process, rounds alternated, medians.

Run: python benchmarks/observability_overhead.py [--clients 4] [--seconds 3] [--rounds 5]
[--smoke] (last line: a JSON object with the ratio)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request

from master_dispatch import run_clients  # benchmarks/ is the script's directory

from elasticdl.cluster.process import free_port
from elasticdl.common.job_report import JobReport
from elasticdl.master import observability
from elasticdl.master.job import JobCore
from elasticdl.master.servicer import MasterServicer, start_master_server
from elasticdl.master.task_manager import TaskManager


def client(addr: str, worker_id: int, seconds: float, start, out) -> None:
    import grpc

    from elasticdl.proto import elasticdl_pb2 as pb
    from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(addr)
    stub = pb_grpc.MasterStub(channel)
    stub.echo(pb.Empty(), timeout=10)
    start.wait()
    n, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        task = stub.get_task(pb.GetTaskRequest(worker_id=worker_id), timeout=10)
        stub.report_task_result(pb.ReportTaskResultRequest(
            task_id=task.task_id, worker_id=worker_id, loss=1.0 / (n + 1),
            learning_rate=0.1), timeout=10)
        n += 1
    out.put(n)
    channel.close()


def measure(addr: str, clients: int, seconds: float) -> float:
    return run_clients(client, lambda i, start, out: (addr, i, seconds, start, out),
                       clients, seconds)


def master(tasks: int, observed: bool):
    tm = TaskManager([("bench", 0, tasks)], records_per_task=1)
    core = JobCore.for_tasks(tm)
    core.report = JobReport("bench", "ParameterServerStrategy", "local", 4, 1,
                            training_records=tasks)
    obs = observability.attach(core, tempfile.mkdtemp(), metrics_port=0, track_ps=True) \
        if observed else None
    warm = core.get(10**6)  # the epoch's tasks are created now, not in the first round
    core.report_task(warm.task_id, 10**6, True, loss=1.0, learning_rate=0.1)
    port = free_port()
    server = start_master_server(MasterServicer(core), port, host="127.0.0.1")
    return f"127.0.0.1:{port}", server, obs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tasks", type=int, default=400_000)
    ap.add_argument("--smoke", action="store_true", help="seconds: 2 clients, 1 round")
    a = ap.parse_args()
    if a.smoke:
        a.clients, a.seconds, a.rounds, a.tasks = 2, 1.0, 1, 20_000
    plain_addr, plain, _ = master(a.tasks, False)
    obs_addr, observed, obs = master(a.tasks, True)
    stop = threading.Event()

    def scrape() -> None:  # a Prometheus scraping every second
        while not stop.wait(1.0):
            urllib.request.urlopen(f"http://{obs.address}/metrics", timeout=10).read()

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    on, off = [], []
    try:
        for r in range(a.rounds):
            off.append(measure(plain_addr, a.clients, a.seconds))
            on.append(measure(obs_addr, a.clients, a.seconds))
            print(f"round {r}: without {off[-1]:.0f}, with observability {on[-1]:.0f} "
                  "round trips/s", flush=True)
    finally:
        stop.set()
        plain.stop(0)
        observed.stop(0)
        dropped = obs.writer.dropped
        obs.close()
    ratio = statistics.median(on) / statistics.median(off)
    print(f"median: without {statistics.median(off):.0f}, with {statistics.median(on):.0f} "
          f"round trips/s, ratio {ratio:.2f}x; TensorBoard scalars dropped: {dropped}")
    print(json.dumps({"without": round(statistics.median(off)),
                      "with": round(statistics.median(on)), "ratio": round(ratio, 3),
                      "dropped": dropped}))


if __name__ == "__main__":
    main()
