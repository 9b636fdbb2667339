"""A master going away can end a worker's call in flight with CANCELLED (seen on the
Kubernetes tier: the master pod deleted, its graceful stop under way, a worker's
get_tasks ended CANCELLED and the worker died with it, relaunched for nothing). The
worker never cancels its own master calls, so the code can only come from the other
side: the call is retried, within the unavailable budget, as UNAVAILABLE is (the
requests are idempotent: a retried get_tasks gets the same lease)."""

from __future__ import annotations

import grpc
import pytest

from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.worker.master_client import MasterClient


class _Cancelled(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        super().__init__()
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class _Flaky:
    """A stub method failing its first ``failures`` calls with ``code``."""

    def __init__(self, failures: int, code: grpc.StatusCode):
        self.failures, self.code, self.calls = failures, code, 0

    def __call__(self, request, timeout):
        self.calls += 1
        if self.calls <= self.failures:
            raise _Cancelled(self.code)
        return pb.TaskLease()


@pytest.mark.parametrize("code", [grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE])
def test_a_call_ended_by_the_master_going_away_is_retried(code):
    client = MasterClient("127.0.0.1:1", 0, call_timeout_s=1, unavailable_timeout_s=10)
    try:
        fn = _Flaky(2, code)
        assert isinstance(client._call(fn, pb.GetTasksRequest()), pb.TaskLease)
        assert fn.calls == 3
    finally:
        client.close()


def test_the_retry_is_bounded_and_other_codes_are_not_retried():
    client = MasterClient("127.0.0.1:1", 0, call_timeout_s=1, unavailable_timeout_s=0.3)
    try:
        with pytest.raises(ConnectionError, match="unreachable"):
            client._call(_Flaky(1000, grpc.StatusCode.CANCELLED), pb.GetTasksRequest())
        fn = _Flaky(1, grpc.StatusCode.INVALID_ARGUMENT)
        with pytest.raises(grpc.RpcError):
            client._call(fn, pb.GetTasksRequest())
        assert fn.calls == 1
    finally:
        client.close()
