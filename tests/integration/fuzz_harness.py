"""Fuzzing every RPC of the master and the PS over real gRPC (issue 12).

One process hosts a master (task manager, rendezvous, evaluation aggregator)
and a PS (a small dense model, buffers, an embedding table, a checkpoint dir),
both requiring the job token. Three kinds of traffic run at once:

* the *checked* fuzzer: random and mutated messages for every RPC (from the
  generated descriptors: a new RPC is fuzzed without a change here), oversize and
  negative fields, wrong dtypes and shapes, truncated and out-of-order chunk
  streams, undecodable bytes; mostly with the token. Each request runs under the
  state lock with a digest of the master's and the PS's state taken before and
  after: a refused request (any non-OK status) must leave the digest unchanged;
* the *stranger*: garbage without or with a wrong token, concurrently;
* a *legitimate client* (worker 0): get_task/report_task_result and PS
  pull/push steps, which must keep succeeding.

A crash is an UNKNOWN status (an exception escaped a handler), a server that
stops answering its health check, or a stranger's call that is not refused.
INTERNAL answers are counted apart (a guarded bug, not a crash).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import torch

from elasticdl.cluster.process import free_port
from elasticdl.common import auth
from elasticdl.common.task import TaskType
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.job import JobCore
from elasticdl.master.rendezvous import Rendezvous
from elasticdl.master.servicer import MasterServicer, start_master_server
from elasticdl.master.task_manager import TaskManager
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc
from elasticdl.ps.server import start_server
from elasticdl.ps.servicer import PServicer
from elasticdl.ps.shard import PSShard, ShardConfig
from elasticdl.worker.master_client import MasterClient
from tests.integration.fuzz_generators import DENSE, TABLE, Generator

LEGIT_WORKER = 0
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}


@dataclass
class FuzzReport:
    seconds: float = 0.0
    tried: int = 0
    stranger_tried: int = 0
    statuses: Counter = field(default_factory=Counter)
    per_method: Counter = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)
    internal: list[str] = field(default_factory=list)
    state_changes_on_refusal: list[str] = field(default_factory=list)
    legit_steps: int = 0
    legit_errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 1), "requests_tried": self.tried,
                "stranger_requests": self.stranger_tried, "crashes": len(self.crashes),
                "internal_errors": len(self.internal),
                "state_changes_on_refusal": len(self.state_changes_on_refusal),
                "legit_steps": self.legit_steps, "legit_errors": len(self.legit_errors),
                "statuses": {k.name if hasattr(k, "name") else str(k): v
                             for k, v in sorted(self.statuses.items(), key=str)},
                "examples": (self.crashes + self.internal + self.state_changes_on_refusal
                             + self.legit_errors)[:10]}


class Target:
    """The master and the PS under test, in this process, with the job token."""

    def __init__(self, job_secrets: auth.JobSecrets, ckpt_dir: str):
        self.secrets = job_secrets
        self.lock = threading.Lock()
        self.shard = PSShard(ShardConfig(ps_id=0, num_ps=1, grads_to_wait=1,
                                         checkpoint_dir=ckpt_dir, keep_checkpoint_max=2),
                             lambda p: torch.optim.SGD(p, lr=0.01))
        gen = torch.Generator().manual_seed(0)
        self.shard.initialize(0, {n: torch.randn(s, generator=gen) for n, s in DENSE.items()},
                              {"steps": torch.tensor(0)}, [TABLE])
        self.ckpt_dir = ckpt_dir
        self.ps, ps_port = start_server(PServicer(self.shard), 0, "127.0.0.1", max_workers=32,
                                        job_secrets=job_secrets)
        self.tm = TaskManager(training_shards=[("t", 0, 20000)],
                              evaluation_shards=[("v", 0, 200)], records_per_task=10,
                              num_epochs=1000, max_task_retries=10 ** 9)
        self.agg = EvaluationAggregator()
        self.tm.evaluation_done_callbacks.append(self.agg.complete)
        self.tm.create_evaluation_tasks(0)
        self.rdzv = Rendezvous("127.0.0.1", free_port, settle_s=0.0, checkin_timeout_s=1.0)
        self.core = JobCore.for_tasks(self.tm, self.agg)
        port = free_port()
        self.master = start_master_server(
            MasterServicer(self.core, self.rdzv, require_identity=True),
            port, host="127.0.0.1", max_workers=32, job_secrets=job_secrets)
        self.addrs = {"Master": f"127.0.0.1:{port}", "PServer": f"127.0.0.1:{ps_port}"}

    def digest(self) -> str:
        """Everything a request could change, hashed."""
        h = hashlib.sha256()
        state = self.shard.state_dict()
        for name in sorted(state["dense"]):
            h.update(name.encode() + state["dense"][name].numpy().tobytes())
        for name in sorted(state["buffers"]):
            h.update(name.encode() + state["buffers"][name].numpy().tobytes())
        for name, table in sorted(state["tables"].items()):
            h.update(name.encode() + repr(_plain(table)).encode())
        h.update(repr(_plain(state["optimizer"])).encode())
        tm = self.tm
        with tm._lock:
            h.update(json.dumps([state["version"], tm._next_id, tm.counts(),
                                 sorted((i, d.worker_id, sorted(d.past))
                                        for i, d in tm._doing.items()),
                                 tm.completed.to_flat(), sorted(tm._attempts.items()),
                                 repr(tm.failure), sorted(tm._workers_seen),
                                 tm.state_dict()]).encode())
        with self.rdzv._lock:
            h.update(repr((sorted(self.rdzv._workers.items()), self.rdzv._version,
                           self.rdzv._plan, self.rdzv._round)).encode())
        h.update(repr((self.agg._sums, self.agg._reported, self.agg.results,
                       self.core.version, self.core.replicas.state_dict())).encode())
        for root, _, files in sorted(os.walk(self.ckpt_dir)):
            h.update(repr((root, sorted(files))).encode())
        return h.hexdigest()

    def close(self) -> None:
        self.ps.stop(0).wait(5)
        self.master.stop(0).wait(5)


def _plain(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return hashlib.sha256(obj.detach().contiguous().numpy().tobytes()).hexdigest()
    if isinstance(obj, np.ndarray):
        return hashlib.sha256(obj.tobytes()).hexdigest()
    if isinstance(obj, dict):
        return sorted((str(k), _plain(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


# ------------------------------------------------------------------ calling
def _callable(channel: grpc.Channel, service: str, method: Any, raw: bool) -> Callable:
    path = f"/{pb.DESCRIPTOR.package}.{service}/{method.name}"
    request_cls = getattr(pb, method.input_type.name)
    kind = {(False, False): channel.unary_unary, (True, False): channel.stream_unary,
            (False, True): channel.unary_stream, (True, True): channel.stream_stream}[
        (method.client_streaming, method.server_streaming)]
    serializer = (lambda b: b) if raw else request_cls.SerializeToString
    return kind(path, request_serializer=serializer, response_deserializer=lambda b: b)


def invoke(fn: Callable, method: Any, request: Any, timeout: float = 10.0
           ) -> tuple[grpc.StatusCode, str]:
    try:
        result = fn(iter(request) if method.client_streaming else request, timeout=timeout)
        if method.server_streaming:
            for _ in result:
                pass
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


class Fuzzer:
    """Runs the three kinds of traffic against a :class:`Target` for ``seconds``."""

    def __init__(self, seconds: float, seed: int = 0):
        self.seconds = seconds
        self.seed = seed
        self.report = FuzzReport()
        self._stop = threading.Event()

    def run(self) -> FuzzReport:
        secrets = auth.generate()
        with tempfile.TemporaryDirectory(prefix="fuzz-ckpt-") as ckpt:
            target = Target(secrets, ckpt)
            try:
                self._run(target)
            finally:
                target.close()
        return self.report

    def _run(self, target: Target) -> None:
        threads = [threading.Thread(target=self._guard, args=(fn, target), name=fn.__name__)
                   for fn in (self._legit, self._stranger, self._health)]
        start = time.monotonic()
        for t in threads:
            t.start()
        try:
            self._checked(target, start + self.seconds)
        finally:
            self._stop.set()
            for t in threads:
                t.join(timeout=60)
            self.report.seconds = time.monotonic() - start

    def _guard(self, fn: Callable[[Target], None], target: Target) -> None:
        try:
            fn(target)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            self.report.legit_errors.append(f"{fn.__name__}: {type(e).__name__}: {e}")

    def _checked(self, target: Target, deadline: float) -> None:
        rng = random.Random(self.seed)
        gen = Generator(rng, target)
        channels = {(svc, rep): auth.client_channel(addr, job_secrets=target.secrets,
                                                    replica=rep)
                    for svc, addr in target.addrs.items()
                    for rep in ("", "worker-1", "worker-2", "worker-0-impostor")}
        methods = [(svc, m) for svc in ("Master", "PServer")
                   for m in pb.DESCRIPTOR.services_by_name[svc].methods]
        try:
            # shuffled rounds over every method, at least one whole round whatever the load:
            # coverage never depends on how many calls a slow machine fits in the time
            order: list[tuple[str, Any]] = []
            rounds = 0
            while time.monotonic() < deadline or rounds == 0:
                if not order:
                    if rounds and time.monotonic() >= deadline:
                        break
                    order = rng.sample(methods, len(methods))
                    rounds += 1
                service, method = order.pop()
                replica = rng.choice(["", "worker-1", "worker-2", "worker-0-impostor"])
                raw, request = self._request(gen, method)
                if hasattr(request, "fatal") and replica == f"worker-{request.worker_id}":
                    request.fatal = False  # an insider may fail the job on purpose; not here
                fn = _callable(channels[(service, replica)], service, method, raw)
                with target.lock:
                    before = target.digest()
                    code, details = invoke(fn, method, request)
                    after = target.digest()
                self._record(f"{service}.{method.name}", code, details,
                             changed=before != after)
        finally:
            for ch in channels.values():
                ch.close()

    def _request(self, gen: Generator, method: Any) -> tuple[bool, Any]:
        r = gen.rng
        if method.name == "push_gradient_chunks":
            return True, gen.gradient_stream()
        base = gen.template(method.name) if r.random() < 0.6 else None
        msg = gen.mutate(base) if base is not None and r.random() < 0.8 else \
            (base or gen.message(method.input_type))
        if r.random() < 0.15:
            data = gen.raw(msg)
            return True, [data] if method.client_streaming else data
        return False, [msg] if method.client_streaming else msg

    def _record(self, what: str, code: grpc.StatusCode, details: str, changed: bool) -> None:
        rep = self.report
        rep.tried += 1
        rep.statuses[code] += 1
        rep.per_method[what] += 1
        if code == grpc.StatusCode.UNKNOWN:
            rep.crashes.append(f"{what}: UNKNOWN (an exception escaped): {details[:300]}")
        elif code == grpc.StatusCode.INTERNAL:
            rep.internal.append(f"{what}: {details[:300]}")
        elif code != grpc.StatusCode.OK and code not in REFUSALS:
            # DEADLINE_EXCEEDED (a hang), UNAVAILABLE, CANCELLED: the server misbehaved
            rep.crashes.append(f"{what}: {code.name}: {details[:300]}")
        if code != grpc.StatusCode.OK and changed:
            rep.state_changes_on_refusal.append(f"{what}: {code.name}: {details[:200]}")

    def _stranger(self, target: Target) -> None:
        rng = random.Random(self.seed + 1)
        gen = Generator(rng, target)
        wrong = auth.JobSecrets("x" * 43)
        chans = [grpc.insecure_channel(a) for a in target.addrs.values()] + \
            [auth.client_channel(a, job_secrets=wrong, replica="worker-0")
             for a in target.addrs.values()]
        services = list(target.addrs)
        try:
            while not self._stop.is_set():
                i = rng.randrange(len(chans))
                service = services[i % 2]
                method = rng.choice(pb.DESCRIPTOR.services_by_name[service].methods)
                raw, request = self._request(gen, method)
                code, details = invoke(_callable(chans[i], service, method, raw), method,
                                       request)
                self.report.stranger_tried += 1
                if code != grpc.StatusCode.UNAUTHENTICATED:
                    self.report.crashes.append(f"stranger {service}.{method.name} got "
                                               f"{code.name}: {details[:200]}")
        finally:
            for ch in chans:
                ch.close()

    def _health(self, target: Target) -> None:
        chans = {s: auth.client_channel(a, job_secrets=target.secrets)
                 for s, a in target.addrs.items()}
        try:
            while not self._stop.wait(0.5):
                for service, ch in chans.items():
                    stub = (pb_grpc.MasterStub if service == "Master" else pb_grpc.PServerStub)(ch)
                    try:
                        stub.echo(pb.Empty(), timeout=10)
                    except grpc.RpcError as e:
                        self.report.crashes.append(f"{service} stopped answering: {e.code()}")
        finally:
            for ch in chans.values():
                ch.close()

    def _legit(self, target: Target) -> None:
        saved = os.environ.get(auth.TOKEN_ENV)
        os.environ[auth.TOKEN_ENV] = target.secrets.token  # as a worker process has it
        try:
            client = MasterClient(target.addrs["Master"], LEGIT_WORKER, call_timeout_s=10,
                                  unavailable_timeout_s=10)
        finally:
            if saved is None:
                del os.environ[auth.TOKEN_ENV]
            else:
                os.environ[auth.TOKEN_ENV] = saved
        ps = pb_grpc.PServerStub(auth.client_channel(target.addrs["PServer"],
                                                     job_secrets=target.secrets))
        gen = Generator(random.Random(self.seed + 2), target)
        try:
            while not self._stop.is_set():
                with target.lock:
                    self._legit_step(client, ps, gen)
                self.report.legit_steps += 1
                time.sleep(0.001)
        finally:
            client.close()

    @staticmethod
    def _legit_step(client: MasterClient, ps: pb_grpc.PServerStub, gen: Generator) -> None:
        task = client.get_task()
        if task.type == TaskType.EVALUATION:
            client.report_evaluation(task, [("acc", 0.5, 10)])
        if task.type not in (TaskType.WAIT, TaskType.NONE):
            client.report_task(task)
        elif task.type == TaskType.NONE:
            raise RuntimeError("the legitimate worker was told the job is over")
        pulled = ps.pull_dense(pb.PullDenseRequest(version=-1), timeout=10)
        req = gen.template("push_gradients")
        req.version, req.worker_id = pulled.version, LEGIT_WORKER
        resp = ps.push_gradients(req, timeout=10)
        if not resp.accepted or resp.version != pulled.version + 1:
            raise RuntimeError(f"legit push not applied: {resp}")


def run_fuzz(seconds: float, seed: int = 0) -> FuzzReport:
    return Fuzzer(seconds, seed).run()
