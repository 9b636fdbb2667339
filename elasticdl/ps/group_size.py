"""Sync PS: the group follows the job's live worker count (elastic scheduling).

A sync PS applies a group of ``grads_to_wait`` pushes per model version. With
``--num_workers=MIN:MAX`` (or after ``elasticdl scale``) fewer workers may run
than ``grads_to_wait``; the PS would then wait ``sync_wait_s`` for every group.
:func:`follow_job_size` polls the master's ``get_job_size`` every
``interval_s`` and tells the shard (:meth:`PSShard.set_live_workers`), which then
completes a group at ``min(grads_to_wait, running workers)`` pushes: one step is
the record-weighted mean of the pushes of one round of the running workers,
the same rule as an allreduce step over the current members (docs/elastic.md).
"""

from __future__ import annotations

import logging
import threading

import grpc

from elasticdl.common import auth
from elasticdl.common.wire import GRPC_OPTIONS
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


def follow_job_size(master_addr: str, replica: str, shard: object, stop: threading.Event,
                    interval_s: float = 2.0) -> threading.Thread:
    """Start the poller (a daemon thread) and return it. ``shard`` has
    ``set_live_workers(n)``; a master that cannot answer leaves the group as it is."""

    def run() -> None:
        channel = auth.client_channel(master_addr, GRPC_OPTIONS, replica=replica)
        stub = pb_grpc.MasterStub(channel)
        last = -1
        try:
            while not stop.wait(interval_s):
                try:
                    size = stub.get_job_size(pb.Empty(), timeout=max(1.0, interval_s))
                except grpc.RpcError as e:
                    logger.debug("get_job_size: %s", e.code())
                    continue
                running = int(size.running_workers)
                if running != last:
                    logger.info("%d worker(s) running: sync group of min(grads_to_wait, %d)",
                                running, running)
                    last = running
                shard.set_live_workers(running)  # type: ignore[attr-defined]
        finally:
            channel.close()

    thread = threading.Thread(target=run, name="job-size", daemon=True)
    thread.start()
    return thread
