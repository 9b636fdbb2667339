"""Master dispatch: task hand-outs + reports per second and get_task latency with
many simulated workers, the master's journal and its metrics listeners on, as a
real job runs, against the old one-task-per-call path in the same run.

The master is the real one in this process: :class:`JobCore` over a
:class:`TaskManager` of training tasks, the gRPC :class:`MasterServicer` on
127.0.0.1, the write-ahead journal (fsynced, group commit) in a temporary
directory, the TensorBoard writer and the Prometheus endpoint attached
(scraped every second). The workers are asyncio coroutines with one channel
each, spread over a few client processes (``--procs``); each works
``--task-ms`` on a task (a sleep: the worker's compute, on some other machine)
and reports its loss and learning rate. Two paths, rounds alternated:

* ``lease``: the worker path of this repository (``LeasedTasks``): one
  ``get_tasks`` call per lease of about ``lease_s`` of work, carrying the
  results of the tasks done since the last call;
* ``single``: the old path, ``get_task`` + ``report_task_result`` per task.

Reported per path (medians of the rounds): tasks done per second, counted in
the master's ledger over the measured window; latency percentiles of the
call that gets tasks (get_tasks or get_task), measured by the workers; CPU of
the master process and of the client processes over the window, and the
machine's load average (the workers share the machine with the master:
client CPU is a cost a real deployment does not put on the master's cores).
``--mode echo`` is the old closed-loop baseline: dispatch round trips against
empty echo calls from ``--clients`` processes.

Run:  python benchmarks/master_dispatch.py [--workers 1000] [--task-ms 250]
      [--seconds 10] [--rounds 3] [--no-journal] [--no-metrics] [--smoke]
The last line is one JSON object (``dispatch_tasks_per_s``, ``dispatch_p99_ms``:
the lease path). ``run_dispatch(num_workers, seconds, journal, metrics)`` runs
one measurement for other scripts (benchmarks/scale.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from typing import Any

from elasticdl.cluster.process import free_port
from elasticdl.common.job_report import JobReport
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.task import TaskType
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.job import JobCore
from elasticdl.master.servicer import MasterServicer, start_master_server
from elasticdl.master.task_manager import TaskManager
from elasticdl.worker.poller import DEFAULT_MAX_LEASE

WARMUP_S = 2.0
SNAPSHOT_EVERY_S = 5.0   # the job controller's report interval
# what a worker leases: --task_lease_s's default
DEFAULT_LEASE_S = next(f.default for f in dataclasses.fields(JobSpec) if f.name == "task_lease_s")


# ------------------------------------------------------------ simulated workers
async def _worker(stub: Any, pb: Any, worker_id: int, lease: float, task_s: float,
                  window: tuple[float, float], stop_at: float, lat: list[float]) -> None:
    size = _lease_size(lease, task_s)
    reports: list[Any] = []
    n = 0
    while time.time() < stop_at:
        t0 = time.time()
        if lease:
            reply = await stub.get_tasks(pb.GetTasksRequest(
                worker_id=worker_id, max_tasks=size, reports=reports), timeout=60)
            reports = []
            tasks = list(reply.tasks)
        else:
            tasks = [await stub.get_task(pb.GetTaskRequest(worker_id=worker_id), timeout=60)]
        t1 = time.time()
        if window[0] <= t0 < window[1]:
            lat.append(t1 - t0)
        if tasks[0].type in (TaskType.WAIT, TaskType.NONE):
            await asyncio.sleep(0.2)
            continue
        if lease and task_s > 0:
            # the lease's work in one sleep: its results travel with the next call
            # anyway, so the master sees the same calls (and the client side, which
            # shares this machine with the master, wakes once per lease, not per task)
            await asyncio.sleep(task_s * len(tasks))
        for task in tasks:
            if task_s > 0 and not lease:
                await asyncio.sleep(task_s)
            n += 1
            report = pb.ReportTaskResultRequest(task_id=task.task_id, worker_id=worker_id,
                                                loss=1.0 / n, learning_rate=0.1)
            if lease:
                reports.append(report)
            else:
                await stub.report_task_result(report, timeout=60)
    if reports:
        await stub.report_task_results(pb.ReportTaskResultsRequest(
            worker_id=worker_id, reports=reports), timeout=60)


async def _workers(addr: str, ids: list[int], lease: float, task_s: float, seconds: float,
                   ready: Any, go: Any, start_at: Any) -> list[float]:
    import grpc

    from elasticdl.proto import elasticdl_pb2 as pb
    from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc

    channels = [grpc.aio.insecure_channel(addr) for _ in ids]
    stubs = [pb_grpc.MasterStub(c) for c in channels]
    await asyncio.gather(*(s.echo(pb.Empty(), timeout=300) for s in stubs))
    ready.put(len(ids))
    while not go.is_set():   # every client process connected: the master says when
        await asyncio.sleep(0.01)
    start = start_at.value
    spread = _cycle_s(lease, task_s)
    window = (start + WARMUP_S + spread, start + WARMUP_S + spread + seconds)
    lat: list[float] = []
    lag: list[float] = []
    monitor = asyncio.ensure_future(_loop_lag(window, lag))
    # starts spread over one call's worth of work, as the calls of a running job's
    # workers are (started together, they would call in lockstep bursts for ever)
    await asyncio.gather(*(_staggered(i, len(ids), spread, _worker(
        s, pb, w, lease, task_s, window, window[1] + 0.5, lat)) for i, (s, w) in
        enumerate(zip(stubs, ids))))
    monitor.cancel()
    for c in channels:
        await c.close()
    return lat, lag


async def _loop_lag(window: tuple[float, float], lag: list[float]) -> None:
    """How late this client's event loop wakes a 10 ms sleep in the window: when it
    is large, the latency the workers measure is their own machine's (the client
    processes share it with the master), not the master's."""
    while True:
        t0 = time.perf_counter()
        await asyncio.sleep(0.01)
        if window[0] <= time.time() < window[1]:
            lag.append(time.perf_counter() - t0 - 0.01)


def _lease_size(lease: float, task_s: float) -> int:
    """What LeasedTasks converges to for tasks of ``task_s`` and leases of ``lease`` s."""
    return max(1, min(DEFAULT_MAX_LEASE, int(lease / task_s))) if task_s > 0 \
        else DEFAULT_MAX_LEASE


def _cycle_s(lease: float, task_s: float) -> float:
    """Seconds between a worker's calls for work."""
    return task_s * (_lease_size(lease, task_s) if lease else 1)


async def _staggered(i: int, n: int, spread_s: float, coro: Any) -> None:
    await asyncio.sleep(spread_s * i / max(n, 1))
    await coro


def _client(addr: str, ids: list[int], lease: float, task_s: float, seconds: float,
            ready: Any, go: Any, start_at: Any, out: Any) -> None:
    lat, lag = asyncio.run(_workers(addr, ids, lease, task_s, seconds, ready, go, start_at))
    out.put((lat, time.process_time(), lag))


# ------------------------------------------------------------------- the master
class Master:
    """The real master of a training job of ``tasks`` one-record tasks."""

    def __init__(self, tasks: int, journal: bool, metrics: bool,
                 snapshot_every_s: float = SNAPSHOT_EVERY_S):
        self.snapshot_every_s = snapshot_every_s
        self.tm = TaskManager([("bench", 0, tasks)], records_per_task=1)
        self.core = JobCore.for_tasks(self.tm, EvaluationAggregator())
        self.core.report = JobReport("bench", "ParameterServerStrategy", "local", 1000, 1,
                                     training_records=tasks)
        self.tmp = tempfile.TemporaryDirectory(prefix="dispatch-")
        self.obs: Any = None
        if metrics:
            from elasticdl.master import observability

            self.obs = observability.attach(self.core, self.tmp.name, metrics_port=0,
                                            track_ps=True)
        if journal:
            from elasticdl.master.journal import Journal

            self.core.attach_journal(Journal(os.path.join(self.tmp.name, "journal")))
        warm = self.core.get(10**6)  # the epoch's tasks are created now
        self.core.report_task(warm.task_id, 10**6, True, loss=1.0, learning_rate=0.1)
        port = free_port()
        self.server = start_master_server(MasterServicer(self.core), port, host="127.0.0.1")
        self.addr = f"127.0.0.1:{port}"
        self._stop = threading.Event()
        self._scraper = threading.Thread(target=self._scrape, daemon=True)
        if self.obs is not None:
            self._scraper.start()
        self.snapshot_lock_ms: list[float] = []
        self._snapshotter = threading.Thread(target=self._snapshots, daemon=True)
        if journal and snapshot_every_s > 0:
            self._snapshotter.start()

    def _snapshots(self) -> None:
        """What the job controller does every report interval: a journal snapshot and
        the report refreshed (both take the core's lock)."""
        while not self._stop.wait(self.snapshot_every_s):
            self.core.snapshot()
            self.snapshot_lock_ms.append(1000 * self.core.snapshot_lock_s)
            with self.core._lock:
                self.core.refresh_report()

    def _scrape(self) -> None:  # a Prometheus scraping every second
        while not self._stop.wait(1.0):
            urllib.request.urlopen(f"http://{self.obs.address}/metrics", timeout=30).read()

    def done(self) -> int:
        return sum(e["records_completed"] for e in self.tm.epochs_report())

    def close(self) -> None:
        self._stop.set()
        self.server.stop(0)
        if self.obs is not None:
            self.obs.close()
        self.tmp.cleanup()


def measure(master: Master, num_workers: int, seconds: float, lease: float, task_s: float,
            procs: int) -> dict[str, Any]:
    """One round: ``num_workers`` workers for ``seconds`` (after a warm-up); ``lease``:
    seconds of work a worker leases per call (0: the single-task path)."""
    ctx = mp.get_context("spawn")
    out, ready, go, start_at = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    ids = list(range(num_workers))
    parts = [p for p in (ids[i::procs] for i in range(procs)) if p]
    ps = [ctx.Process(target=_client, args=(master.addr, p, lease, task_s, seconds, ready,
                                            go, start_at, out)) for p in parts]
    for p in ps:
        p.start()
    for _ in ps:   # every worker connected (a loaded machine takes its time)
        ready.get(timeout=600)
    start_at.value = start = time.time() + 0.2
    go.set()
    spread = _cycle_s(lease, task_s)
    window = (start + WARMUP_S + spread, start + WARMUP_S + spread + seconds)
    while time.time() < window[0]:
        time.sleep(0.01)
    done0, cpu0, wall0 = master.done(), time.process_time(), time.time()
    load0 = os.getloadavg()[0]
    while time.time() < window[1]:
        time.sleep(0.01)
    done1, cpu1, wall1 = master.done(), time.process_time(), time.time()
    results = [out.get(timeout=600 + seconds) for _ in ps]
    for p in ps:
        p.join(timeout=60)
    lat = sorted(x for r in results for x in r[0])
    client_cpu = sum(r[1] for r in results)   # the whole run of each client process
    lags = sorted(x for r in results for x in r[2])
    span = wall1 - wall0

    def pct(q: float) -> float:
        return 1000 * lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")

    rate = (done1 - done0) / span
    return {"tasks_per_s": rate, "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "calls": len(lat), "master_cpu": (cpu1 - cpu0) / span,
            "master_cpu_us_per_task": 1e6 * (cpu1 - cpu0) / max(done1 - done0, 1),
            "clients_cpu_s": client_cpu, "load": max(load0, os.getloadavg()[0]),
            "snapshot_lock_ms": max(master.snapshot_lock_ms, default=float("nan")),
            "client_loop_lag_p99_ms": 1000 * lags[min(len(lags) - 1, int(0.99 * len(lags)))]
            if lags else float("nan")}


def run_dispatch(num_workers: int, seconds: float, journal: bool = True,
                 metrics: bool = True, lease: bool = True, task_ms: float = 250.0,
                 procs: int = 4, lease_s: float = DEFAULT_LEASE_S,
                 snapshot_every_s: float = SNAPSHOT_EVERY_S) -> dict[str, Any]:
    """One measurement of a fresh master (see the module): ``tasks_per_s``,
    ``p50_ms``, ``p99_ms`` (of the call that gets tasks), ``master_cpu``
    (cores), ``master_cpu_us_per_task``, ``load``. ``lease``: the lease path
    (``lease_s`` of work per call), else the single-task one; ``snapshot_every_s``
    0: no periodic snapshot."""
    task_s = task_ms / 1000
    offered = num_workers / task_s if task_s > 0 else 20_000
    master = Master(int(offered * (seconds + 30)) + 10_000, journal, metrics,
                    snapshot_every_s)
    try:
        return measure(master, num_workers, seconds, lease_s if lease else 0.0, task_s, procs)
    finally:
        master.close()


# ------------------------------------------------------------ CPU per task, no gRPC
class _Context:
    """What the servicer reads of a gRPC context (no replica identity)."""

    def invocation_metadata(self) -> tuple:
        return ()

    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")


def cpu_per_task(num_workers: int, tasks: int, journal: bool, metrics: bool,
                 lease: int) -> float:
    """Master CPU (all its threads) per task handed out and reported through the
    real servicer's handlers, called in turn for ``num_workers`` workers (no gRPC,
    no concurrency): the figure a loaded machine distorts least. ``lease``: tasks
    per get_tasks call, results carried by the next one (0: get_task +
    report_task_result per task)."""
    from elasticdl.proto import elasticdl_pb2 as pb

    master = Master(tasks + 2 * num_workers * max(lease, 1) + 10, journal, metrics)
    servicer, ctx = MasterServicer(master.core), _Context()
    held: dict[int, list[Any]] = {w: [] for w in range(num_workers)}

    def result(task: Any, w: int) -> Any:
        return pb.ReportTaskResultRequest(task_id=task.task_id, worker_id=w, loss=0.5,
                                          learning_rate=0.1, model_version=0)

    def step(w: int) -> int:
        if lease:
            reports = [result(t, w) for t in held[w]]
            held[w] = list(servicer.get_tasks(pb.GetTasksRequest(
                worker_id=w, max_tasks=lease, reports=reports), ctx).tasks)
            return len(reports)
        for t in held[w]:
            servicer.report_task_result(result(t, w), ctx)
        held[w] = [servicer.get_task(pb.GetTaskRequest(worker_id=w), ctx)]
        return 1

    try:
        for w in range(num_workers):
            step(w)
        done, i = 0, 0
        cpu0 = time.process_time()
        while done < tasks:
            done += step(i % num_workers)
            i += 1
        return 1e6 * (time.process_time() - cpu0) / done
    finally:
        master.server.stop(0)
        master.close()


def inproc_main(a: argparse.Namespace) -> None:
    rows = {}
    for journal in (False, True):
        for metrics in (False, True):
            for lease in (0, 16):
                us = statistics.median(cpu_per_task(a.workers, a.inproc_tasks, journal,
                                                    metrics, lease) for _ in range(a.rounds))
                key = f"journal={int(journal)} metrics={int(metrics)} " + \
                    (f"lease={lease}" if lease else "single")
                rows[key] = round(us, 1)
                print(f"{key:34s} {us:6.0f} us master CPU per task (~{1e6 / us:.0f} "
                      "tasks/s per core)", flush=True)
    print(json.dumps({"cpu_us_per_task": rows, "load": os.getloadavg()[0]}))


# ------------------------------------------------------- the closed-loop baseline
def echo_client(addr: str, worker_id: int, mode: str, seconds: float, start, out) -> None:
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


def echo_main(a: argparse.Namespace) -> None:
    tm = TaskManager(prediction_shards=[("bench", 0, a.tasks)], records_per_task=1)
    port = free_port()
    core = JobCore.for_tasks(tm, EvaluationAggregator())
    tmp = tempfile.TemporaryDirectory(prefix="dispatch-")
    if a.journal:
        from elasticdl.master.journal import Journal

        core.attach_journal(Journal(tmp.name))
    server = start_master_server(MasterServicer(core), port, host="127.0.0.1")
    addr = f"127.0.0.1:{port}"
    dispatch, echo = [], []
    try:
        for r in range(a.rounds):
            for mode, into in (("dispatch", dispatch), ("echo", echo)):
                into.append(run_clients(echo_client, lambda i, start, out, m=mode: (
                    addr, i, m, a.seconds, start, out), a.clients, a.seconds))
            print(f"round {r}: dispatch {dispatch[-1]:.0f} round trips/s, "
                  f"echo {echo[-1]:.0f} pairs/s", flush=True)
    finally:
        server.stop(0)
        tmp.cleanup()
    d, e = statistics.median(dispatch), statistics.median(echo)
    print(f"median: dispatch {d:.0f} round trips/s ({2 * d:.0f} RPC/s), echo {e:.0f} "
          f"pairs/s ({2 * e:.0f} RPC/s), ratio {d / e:.2f}x")
    print(json.dumps({"dispatch_round_trips_per_s": round(d), "echo_pairs_per_s": round(e)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("workers", "echo", "inproc"), default="workers")
    ap.add_argument("--inproc-tasks", type=int, default=20_000)
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--task-ms", type=float, default=250.0,
                    help="a task's simulated work (0: none, as fast as the master goes)")
    ap.add_argument("--procs", type=int, default=4, help="client processes")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-journal", dest="journal", action="store_false")
    ap.add_argument("--no-metrics", dest="metrics", action="store_false")
    ap.add_argument("--paths", default="lease,single")
    ap.add_argument("--snapshot-every-s", type=float, default=SNAPSHOT_EVERY_S,
                    help="the journal snapshot + report refresh period (0: none)")
    ap.add_argument("--lease-s", type=float, default=DEFAULT_LEASE_S,
                    help="seconds of work leased per call (--task_lease_s)")
    ap.add_argument("--smoke", action="store_true", help="a few seconds, 50 workers")
    # --mode echo
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tasks", type=int, default=5_000_000)
    a = ap.parse_args()
    if a.mode == "echo":
        echo_main(a)
        return
    if a.mode == "inproc":
        inproc_main(a)
        return
    if a.smoke:
        a.workers, a.seconds, a.rounds, a.procs, a.task_ms = 50, 2.0, 1, 2, 50.0
    paths = a.paths.split(",")
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
    for r in range(a.rounds):
        for path in paths:
            res = run_dispatch(a.workers, a.seconds, a.journal, a.metrics, path == "lease",
                               a.task_ms, a.procs, a.lease_s, a.snapshot_every_s)
            runs[path].append(res)
            print(f"round {r} {path:6s}: {res['tasks_per_s']:7.0f} tasks/s, get p50 "
                  f"{res['p50_ms']:6.1f} ms p99 {res['p99_ms']:7.1f} ms ({res['calls']} "
                  f"calls), master CPU {res['master_cpu']:.2f} cores "
                  f"({res['master_cpu_us_per_task']:.0f} us/task), clients "
                  f"{res['clients_cpu_s']:.1f} CPU-s (loop lag p99 "
                  f"{res['client_loop_lag_p99_ms']:.0f} ms), snapshot lock max "
                  f"{res['snapshot_lock_ms']:.1f} ms, load {res['load']:.1f}", flush=True)
    summary: dict[str, Any] = {"workers": a.workers, "task_ms": a.task_ms,
                               "lease_s": a.lease_s,
                               "offered_tasks_per_s": round(a.workers * 1000 / a.task_ms)
                               if a.task_ms else None,
                               "journal": a.journal, "metrics": a.metrics,
                               "cpus": os.cpu_count()}
    for path, rs in runs.items():
        med = {k: statistics.median(x[k] for x in rs) for k in
               ("tasks_per_s", "p50_ms", "p99_ms", "master_cpu", "master_cpu_us_per_task",
                "load", "client_loop_lag_p99_ms", "snapshot_lock_ms")}
        print(f"median {path:6s}: {med['tasks_per_s']:.0f} tasks/s, get p50 "
              f"{med['p50_ms']:.1f} ms, p99 {med['p99_ms']:.1f} ms, master CPU "
              f"{med['master_cpu']:.2f} cores ({med['master_cpu_us_per_task']:.0f} us per "
              f"task), load {med['load']:.1f}")
        summary[path] = {k: round(v, 2) for k, v in med.items()}
    main_path = "lease" if "lease" in runs else paths[0]
    summary["dispatch_tasks_per_s"] = round(summary[main_path]["tasks_per_s"])
    summary["dispatch_p99_ms"] = summary[main_path]["p99_ms"]
    if "lease" in runs and "single" in runs:
        summary["ratio_vs_single"] = round(summary["lease"]["tasks_per_s"] /
                                           max(summary["single"]["tasks_per_s"], 1e-9), 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
