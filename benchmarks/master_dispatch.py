"""Master dispatch throughput: get_task + report_task_result round trips from 4
concurrent client processes, against the same number of empty gRPC echo calls
to the same server, measured in the same run (alternating rounds; medians).

A dispatch round trip is two RPCs, so the baseline is two echo calls; the
ratio is the master's per-RPC throughput relative to gRPC doing nothing.
Run: python benchmarks/master_dispatch.py [--clients 4] [--seconds 3] [--rounds 5]
[--journal DIR] (the master's write-ahead journal on, in DIR: the failover cost)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

from elasticdl.cluster.process import free_port
from elasticdl.common.task import TaskType
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.job import JobCore
from elasticdl.master.servicer import MasterServicer, start_master_server
from elasticdl.master.task_manager import TaskManager


def client(addr: str, worker_id: int, mode: str, seconds: float, start, out) -> None:
    import grpc

    from elasticdl.proto import elasticdl_pb2 as pb
    from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(addr)
    stub = pb_grpc.MasterStub(channel)
    stub.echo(pb.Empty(), timeout=10)
    start.wait()
    n, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if mode == "dispatch":
            task = stub.get_task(pb.GetTaskRequest(worker_id=worker_id), timeout=10)
            assert task.type == TaskType.PREDICTION
            stub.report_task_result(pb.ReportTaskResultRequest(
                task_id=task.task_id, worker_id=worker_id), timeout=10)
        else:
            stub.echo(pb.Empty(), timeout=10)
            stub.echo(pb.Empty(), timeout=10)
        n += 1
    out.put(n)
    channel.close()


def run_clients(target, args_of, clients: int, seconds: float) -> float:
    """Start ``clients`` spawned processes ``target(*args_of(i, start, out))``, release them
    together, and return the calls per second they put on ``out`` in all."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=args_of(i, start, out)) for i in range(clients)]
    for p in procs:
        p.start()
    time.sleep(1.5)  # let every client connect
    start.set()
    total = sum(out.get(timeout=seconds + 60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return total / seconds


def measure(addr: str, mode: str, clients: int, seconds: float) -> float:
    return run_clients(client, lambda i, start, out: (addr, i, mode, seconds, start, out),
                       clients, seconds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--journal", default="", help="journal every transition in this "
                    "directory (fsynced before each reply), as a failover master does")
    ap.add_argument("--tasks", type=int, default=50_000_000,
                    help="tasks queued (about 300 bytes of master memory each)")
    ap.add_argument("--smoke", action="store_true", help="seconds: 10k tasks, 1 short round")
    a = ap.parse_args()
    if a.smoke:
        a.clients, a.seconds, a.rounds, a.tasks = 2, 0.5, 1, 10_000
    tm = TaskManager(prediction_shards=[("bench", 0, a.tasks)], records_per_task=1)
    port = free_port()
    core = JobCore.for_tasks(tm, EvaluationAggregator())
    if a.journal:
        from elasticdl.master.journal import Journal

        core.attach_journal(Journal(a.journal))
    server = start_master_server(MasterServicer(core), port, host="127.0.0.1")
    addr = f"127.0.0.1:{port}"
    dispatch, echo = [], []
    try:
        for r in range(a.rounds):
            dispatch.append(measure(addr, "dispatch", a.clients, a.seconds))
            echo.append(measure(addr, "echo", a.clients, a.seconds))
            print(f"round {r}: dispatch {dispatch[-1]:.0f} round trips/s, "
                  f"echo {echo[-1]:.0f} pairs/s", flush=True)
    finally:
        server.stop(0)
    d, e = statistics.median(dispatch), statistics.median(echo)
    print(f"median: dispatch {d:.0f} round trips/s ({2 * d:.0f} RPC/s), echo {e:.0f} "
          f"pairs/s ({2 * e:.0f} RPC/s), ratio {d / e:.2f}x (target >= 0.7x)")


if __name__ == "__main__":
    main()
