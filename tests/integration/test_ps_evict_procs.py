"""Admission and eviction through real PS processes (issue 29): the job's flags reach
``python -m elasticdl.ps.main``, a layer's own setting travels in push_model, and the PS
export of rows (``export_rows`` RPC) holds only admitted, unexpired rows."""

from __future__ import annotations

import os

import numpy as np
import torch

from elasticdl.common.job_spec import JobSpec
from elasticdl.common.tables import TableSpec
from elasticdl.worker.ps_client import PSClient
from tests.integration.ps_procs import ROOT, PSProcess

DIM = 4


def _exported(client: PSClient, table: str) -> list[int]:
    ids: list[int] = []
    client.export_rows(table, DIM, torch.float32, lambda page, _rows: ids.extend(page.tolist()))
    return sorted(ids)


def _step(client: PSClient, table: str, ids: np.ndarray) -> None:
    """A training pull, then a push to each PS of its ids (one version each, async)."""
    client.pull_embedding_unique(table, ids, DIM)
    for ps in range(2):
        mine = ids[ids % 2 == ps]
        client.push_gradients(ps, 0, {}, [(table, mine, torch.ones(mine.shape[0], DIM))]
                              ).result()


def test_flags_and_layer_settings_reach_real_ps_processes(tmp_path):
    job = JobSpec(model_zoo=os.path.join(ROOT, "model_zoo"),
                  model_def="digits.digits_cnn.custom_model", training_data="unused",
                  distribution_strategy="ParameterServerStrategy", num_ps_pods=2,
                  use_async=True, embedding_admit_after=2, embedding_ttl_versions=3)
    procs: list[PSProcess] = []
    client = None
    try:
        procs = [PSProcess(i, 2, job, log_path=str(tmp_path / f"ps-{i}.log")) for i in range(2)]
        client = PSClient([p.addr for p in procs], rpc_timeout_s=60)
        client.wait_ready(60)
        client.push_model(0, {}, {}, [
            TableSpec("jobs", 1 << 40, DIM, initializer="zeros"),          # the flags
            TableSpec("own", 1 << 40, DIM, initializer="zeros", admit_after=1,
                      ttl_versions=0)])                                     # its own
        ids = np.arange(10, dtype=np.int64)
        client.pull_embedding_unique("jobs", ids, DIM)
        client.pull_embedding_unique("own", ids, DIM)
        assert _exported(client, "jobs") == []           # seen once: no rows yet
        assert _exported(client, "own") == list(range(10))
        client.pull_embedding_unique("jobs", ids, DIM)   # the second time: rows
        assert _exported(client, "jobs") == list(range(10))
        for _ in range(4):                               # only 0 and 1 keep being updated
            _step(client, "jobs", np.array([0, 1], dtype=np.int64))
        assert _exported(client, "jobs") == [0, 1]
        assert _exported(client, "own") == list(range(10))
    finally:
        if client is not None:
            client.close()
        for p in procs:
            p.kill()
