"""A real job through the CLI with the job token and --grpc_tls on: it trains to the
end, while its master and PS ports refuse callers without the job's token
(issue 12)."""

from __future__ import annotations

import os
import re
import stat

import grpc
import pytest

from elasticdl.common import auth
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc
from tests.integration.helpers import kill_job_tree, read_json, start_cli, wait_for
from tests.integration.test_chaos import train_args

pytestmark = pytest.mark.integration


def ps_port(job_dir: str) -> int:
    try:
        text = open(os.path.join(job_dir, "logs", "ps-0.log")).read()
    except OSError:
        return 0
    m = re.search(r"PS 0 serving on port (\d+)", text)
    return int(m.group(1)) if m else 0


def refusal(channel: grpc.Channel, master: bool) -> grpc.StatusCode:
    try:
        if master:
            pb_grpc.MasterStub(channel).get_task(pb.GetTaskRequest(worker_id=0), timeout=30)
        else:
            pb_grpc.PServerStub(channel).save_checkpoint(pb.SaveCheckpointRequest(),
                                                         timeout=30)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_ps_job_trains_with_token_and_tls_while_strangers_are_refused(digits_data, tmp_path):
    job_dir = str(tmp_path / "secure")
    proc = start_cli(train_args(digits_data, job_dir, "secure-ps", num_epochs=2,
                                distribution_strategy="ParameterServerStrategy",
                                num_workers=2, num_ps_pods=1, grpc_tls="true",
                                checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_steps=20),
                     str(tmp_path / "home"), str(tmp_path / "cli.log"))
    try:
        # probe while the job certainly runs: as soon as the PS serves (the report,
        # written every few seconds, can lag until a short job's PS is gone)
        ps_addr = f"127.0.0.1:{wait_for(lambda: ps_port(job_dir), 240, 'the PS port')}"
        secrets_dir = os.path.join(job_dir, auth.SECRETS_DIR)
        for name in (auth.TOKEN_KEY, auth.CERT_KEY, auth.KEY_KEY):
            mode = stat.S_IMODE(os.stat(os.path.join(secrets_dir, name)).st_mode)
            assert mode == 0o600, (name, oct(mode))
        job = auth.read_job_secrets(job_dir)
        assert job is not None and job.tls
        stranger = auth.JobSecrets("s" * 43, job.tls_cert, job.tls_key)  # cert, no token
        master_addr = f"127.0.0.1:{read_json(os.path.join(job_dir, 'master.json'))['port']}"
        for addr, master in ((master_addr, True), (ps_addr, False)):
            plain = grpc.insecure_channel(addr)
            wrong = auth.client_channel(addr, job_secrets=stranger, replica="worker-0")
            try:
                assert refusal(plain, master) == grpc.StatusCode.UNAVAILABLE  # TLS only
                assert refusal(wrong, master) == grpc.StatusCode.UNAUTHENTICATED
            finally:
                plain.close()
                wrong.close()
        code = proc.wait(timeout=400)
        assert code == 0, (tmp_path / "cli.log").read_text()[-4000:]
    finally:
        kill_job_tree(proc, job_dir)
    report = read_json(os.path.join(job_dir, "job_report.json"))
    assert report["status"] == "succeeded", report.get("failure")
    assert [e["records_completed"] for e in report["epochs"]] == [1437] * 2
    assert report["final_metrics"]["accuracy"] >= 0.85, report["evaluations"]  # it learned
    master_log = open(os.path.join(job_dir, "logs", "master.log")).read()
    assert "job token + TLS" in master_log
    assert "job token + TLS" in open(os.path.join(job_dir, "logs", "ps-0.log")).read()
