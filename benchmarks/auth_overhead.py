"""Cost of the job token on the wire: the latency of an empty RPC (``echo``) and of a
small one (``pull_dense`` of a 1 KiB model) on a PS without authentication, with
the token interceptor, and with token + TLS. The servers run in another process;
calls are sequential from one client; rounds alternate the modes; the figure is
the median over rounds of each round's median latency.

Run: python benchmarks/auth_overhead.py [--calls 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("open", "token", "token+tls")


def serve(secrets_env: dict, ports, stop) -> None:
    import torch

    from elasticdl.common import auth
    from elasticdl.ps.server import start_server
    from elasticdl.ps.servicer import PServicer
    from elasticdl.ps.shard import PSShard, ShardConfig

    secrets = auth.JobSecrets.from_env(secrets_env)
    assert secrets is not None
    plain = auth.JobSecrets(secrets.token)
    servers = []
    for mode, job_secrets in zip(MODES, (None, plain, secrets)):
        shard = PSShard(ShardConfig(ps_id=0, num_ps=1), lambda p: torch.optim.SGD(p, lr=0.1))
        shard.initialize(1, {"w": torch.ones(16, 16)}, {}, [])  # 1 KiB
        server, port = start_server(PServicer(shard), 0, "127.0.0.1", max_workers=8,
                                    job_secrets=job_secrets)
        servers.append(server)
        ports.put((mode, port))
    stop.wait(3600)
    for s in servers:
        s.stop(0)


def latencies(stub, rpc: str, calls: int) -> float:
    from elasticdl.proto import elasticdl_pb2 as pb

    fn, req = ((stub.echo, pb.Empty()) if rpc == "echo"
               else (stub.pull_dense, pb.PullDenseRequest(version=-1)))
    for _ in range(50):
        fn(req, timeout=10)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn(req, timeout=10)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="seconds: 20 calls, 1 round")
    a = ap.parse_args()
    if a.smoke:
        a.calls, a.rounds = 20, 1
    import grpc

    from elasticdl.common import auth
    from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc

    secrets = auth.generate(tls=True)
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=serve, args=(secrets.env(), ports, stop), daemon=True)
    proc.start()
    try:
        addr = dict(ports.get(timeout=120) for _ in MODES)
        channels = {
            "open": grpc.insecure_channel(f"127.0.0.1:{addr['open']}"),
            "token": auth.client_channel(f"127.0.0.1:{addr['token']}",
                                         job_secrets=auth.JobSecrets(secrets.token)),
            "token+tls": auth.client_channel(f"127.0.0.1:{addr['token+tls']}",
                                             job_secrets=secrets)}
        stubs = {m: pb_grpc.PServerStub(c) for m, c in channels.items()}
        results: dict[tuple[str, str], list[float]] = {}
        for r in range(a.rounds):
            for rpc in ("echo", "pull_dense"):
                for mode in MODES:
                    results.setdefault((rpc, mode), []).append(
                        latencies(stubs[mode], rpc, a.calls))
            print(f"round {r}: " + ", ".join(
                f"{rpc}/{mode} {results[(rpc, mode)][-1] * 1e6:.0f} us"
                for rpc in ("echo", "pull_dense") for mode in MODES), flush=True)
        for rpc in ("echo", "pull_dense"):
            med = {m: statistics.median(results[(rpc, m)]) * 1e6 for m in MODES}
            print(f"median {rpc}: open {med['open']:.0f} us, token {med['token']:.0f} us "
                  f"({med['token'] / med['open']:.2f}x), token+TLS {med['token+tls']:.0f} us "
                  f"({med['token+tls'] / med['open']:.2f}x)")
        for c in channels.values():
            c.close()
    finally:
        stop.set()
        proc.join(timeout=30)


if __name__ == "__main__":
    main()
