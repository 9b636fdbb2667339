"""A bounded fuzz run over every RPC of the master and the PS (issue 12); the long
run is ``python benchmarks/fuzz_rpc.py --seconds 300``. See fuzz_harness.py."""

from __future__ import annotations

import grpc
import pytest

from elasticdl.proto import elasticdl_pb2 as pb
from tests.integration.fuzz_harness import run_fuzz

pytestmark = pytest.mark.integration


def test_fuzzing_every_rpc_crashes_nothing_changes_nothing_and_the_job_goes_on():
    report = run_fuzz(seconds=10.0, seed=12)
    summary = report.summary()
    assert report.crashes == [], summary
    assert report.internal == [], summary
    assert report.state_changes_on_refusal == [], summary
    assert report.legit_errors == [], summary
    assert report.legit_steps >= 10, summary  # the legitimate worker kept training
    assert report.stranger_tried >= 50, summary
    every = {f"{svc}.{m.name}" for svc in ("Master", "PServer")
             for m in pb.DESCRIPTOR.services_by_name[svc].methods}
    assert set(report.per_method) == every, every - set(report.per_method)
    for code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                 grpc.StatusCode.PERMISSION_DENIED):
        assert report.statuses[code] > 0, summary  # the fuzz reached past each gate
