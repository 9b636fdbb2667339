"""The job token and TLS on the wire (issue 12): every RPC of both services,
enumerated from the generated descriptors, refuses a call without the token or
with a wrong one; the right token gets through (over TLS too); the replica
identity a worker's channel declares must match the ids it sends; the secrets
are stored privately."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator

import grpc
import pytest
import torch

from elasticdl.cluster.process import free_port
from elasticdl.common import auth
from elasticdl.master.evaluation import EvaluationAggregator
from elasticdl.master.job import JobCore
from elasticdl.master.servicer import MasterServicer, start_master_server
from elasticdl.master.task_manager import TaskManager
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc
from elasticdl.ps.server import start_server
from elasticdl.ps.servicer import PServicer
from elasticdl.ps.shard import PSShard, ShardConfig
from elasticdl.worker.master_client import MasterClient

SECRETS = auth.JobSecrets("t" * 43)
SERVICES = ("Master", "PServer")


def rpc_methods(service: str) -> list:
    return list(pb.DESCRIPTOR.services_by_name[service].methods)


def call(channel: grpc.Channel, service: str, method, timeout: float = 30.0) -> None:
    """One call of ``method`` with a default request, whatever its cardinality."""
    request_cls = getattr(pb, method.input_type.name)
    response_cls = getattr(pb, method.output_type.name)
    path = f"/{pb.DESCRIPTOR.package}.{service}/{method.name}"
    kinds = {(False, False): channel.unary_unary, (True, False): channel.stream_unary,
             (False, True): channel.unary_stream, (True, True): channel.stream_stream}
    fn = kinds[(method.client_streaming, method.server_streaming)](
        path, request_serializer=request_cls.SerializeToString,
        response_deserializer=response_cls.FromString)
    request = iter([request_cls()]) if method.client_streaming else request_cls()
    result = fn(request, timeout=timeout)
    if method.server_streaming:
        list(result)


def code_of(channel: grpc.Channel, service: str, method) -> grpc.StatusCode:
    try:
        call(channel, service, method)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@contextlib.contextmanager
def servers(job_secrets: auth.JobSecrets) -> Iterator[dict]:
    shard = PSShard(ShardConfig(ps_id=0, num_ps=1), lambda p: torch.optim.SGD(p, lr=0.1))
    shard.initialize(2, {"w": torch.ones(4, 4)}, {}, [])
    ps, ps_port = start_server(PServicer(shard), 0, "127.0.0.1", max_workers=8,
                               job_secrets=job_secrets)
    tm = TaskManager(training_shards=[("t", 0, 40)], records_per_task=10)
    port = free_port()
    master = start_master_server(MasterServicer(JobCore.for_tasks(tm, EvaluationAggregator()),
                                                require_identity=True),
                                 port, host="127.0.0.1", job_secrets=job_secrets)
    try:
        yield {"PServer": f"127.0.0.1:{ps_port}", "Master": f"127.0.0.1:{port}",
               "shard": shard, "tm": tm}
    finally:
        ps.stop(0).wait(5)
        master.stop(0).wait(5)


def test_the_services_have_the_rpcs_we_think():
    assert len(rpc_methods("Master")) >= 9 and len(rpc_methods("PServer")) >= 9


@pytest.mark.parametrize("service", SERVICES)
def test_every_rpc_refuses_a_missing_or_wrong_token_and_changes_nothing(service):
    with servers(SECRETS) as s:
        shard, tm = s["shard"], s["tm"]
        before = (shard.params.dense["w"].clone(), shard.version, tm.counts())
        wrong = auth.JobSecrets("w" * 43)
        plain = grpc.insecure_channel(s[service])
        forged = auth.client_channel(s[service], job_secrets=wrong, replica="worker-0")
        good = auth.client_channel(s[service], job_secrets=SECRETS, replica="worker-0")
        try:
            for method in rpc_methods(service):
                for channel, what in ((plain, "no job token"), (forged, "wrong job token")):
                    try:
                        call(channel, service, method)
                    except grpc.RpcError as e:
                        assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (method.name, what)
                        assert what in e.details()
                    else:
                        raise AssertionError(f"{method.name} served a call with {what}")
            assert torch.equal(shard.params.dense["w"], before[0])
            assert (shard.version, tm.counts()) == before[1:]
            # the token opens every method (whatever the handler then says of an empty
            # request, it is not UNAUTHENTICATED)
            for method in rpc_methods(service):
                assert code_of(good, service, method) != grpc.StatusCode.UNAUTHENTICATED
        finally:
            for ch in (plain, forged, good):
                ch.close()


def test_a_workers_channel_may_only_speak_for_its_own_worker_id(monkeypatch):
    monkeypatch.setenv(auth.TOKEN_ENV, SECRETS.token)
    with servers(SECRETS) as s:
        client = MasterClient(s["Master"], worker_id=0, unavailable_timeout_s=5)
        try:
            task = client.get_task()  # the environment's token, replica worker-0
            client.report_task(task)
            assert s["tm"].counts()["completed"] == 1
        finally:
            client.close()
        impostor = auth.client_channel(s["Master"], job_secrets=SECRETS, replica="worker-1")
        anonymous = auth.client_channel(s["Master"], job_secrets=SECRETS)
        try:
            for channel in (impostor, anonymous):
                with pytest.raises(grpc.RpcError) as e:
                    pb_grpc.MasterStub(channel).get_task(pb.GetTaskRequest(worker_id=0),
                                                         timeout=30)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        finally:
            impostor.close()
            anonymous.close()


def test_tls_pins_the_job_certificate_and_still_needs_the_token():
    tls = auth.generate(tls=True)
    other = auth.generate(tls=True)
    with servers(tls) as s:
        echo = [m for m in rpc_methods("PServer") if m.name == "echo"][0]
        good = auth.client_channel(s["PServer"], job_secrets=tls)
        plain = grpc.insecure_channel(s["PServer"])
        wrong_cert = auth.client_channel(s["PServer"], job_secrets=other)
        wrong_token = auth.client_channel(
            s["PServer"], job_secrets=auth.JobSecrets("x" * 43, tls.tls_cert, tls.tls_key))
        try:
            assert code_of(good, "PServer", echo) == grpc.StatusCode.OK
            assert code_of(plain, "PServer", echo) == grpc.StatusCode.UNAVAILABLE
            assert code_of(wrong_cert, "PServer", echo) == grpc.StatusCode.UNAVAILABLE
            assert code_of(wrong_token, "PServer", echo) == grpc.StatusCode.UNAUTHENTICATED
        finally:
            for ch in (good, plain, wrong_cert, wrong_token):
                ch.close()


def test_secrets_are_stored_privately_and_reused(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    job_dir = str(tmp_path / "job")
    os.makedirs(job_dir)
    first = auth.ensure_job_secrets(job_dir, tls=False)
    path = os.path.join(job_dir, auth.SECRETS_DIR)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(path, auth.TOKEN_KEY)).st_mode) == 0o600
    assert auth.ensure_job_secrets(job_dir, tls=False) == first
    with_tls = auth.ensure_job_secrets(job_dir, tls=True)  # same token, a certificate added
    assert with_tls.token == first.token and with_tls.tls
    assert stat.S_IMODE(os.stat(os.path.join(path, auth.KEY_KEY)).st_mode) == 0o600
    assert first.token not in repr(first)
    assert auth.JobSecrets.from_env(first.env()) == first
    assert auth.JobSecrets.from_env(with_tls.env()) == with_tls
    with pytest.raises(auth.AuthError):
        auth.JobSecrets("short")
