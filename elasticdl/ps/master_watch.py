"""The PS watches its master: a PS whose master is gone for good exits.

A master may die and be relaunched (master failover): the PS keeps serving
while it is away. Every ``interval_s`` the watch calls the master's ``echo``;
once no call succeeded for ``timeout_s`` (``--master_reconnect_timeout_s``)
the master counts as gone for good and ``stop`` is set, so no PS outlives its
job by more than that (plus one interval and the PS's grace period).
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from elasticdl.common import auth
from elasticdl.common.wire import GRPC_OPTIONS
from elasticdl.proto import elasticdl_pb2 as pb
from elasticdl.proto import elasticdl_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


def watch_master(master_addr: str, replica: str, stop: threading.Event, timeout_s: float,
                 interval_s: float = 2.0) -> threading.Thread:
    """Start the watch (a daemon thread) and return it."""

    def run() -> None:
        channel = auth.client_channel(master_addr, GRPC_OPTIONS, replica=replica)
        stub = pb_grpc.MasterStub(channel)
        last_seen = time.monotonic()
        away = False
        try:
            while not stop.wait(interval_s):
                try:
                    stub.echo(pb.Empty(), timeout=max(1.0, interval_s))
                except grpc.RpcError as e:
                    gone = time.monotonic() - last_seen
                    if not away:
                        logger.warning("master %s unreachable (%s); waiting up to %.0f s "
                                       "for it to come back", master_addr, e.code(), timeout_s)
                        away = True
                    if gone >= timeout_s:
                        logger.error("master %s unreachable for %.0f s: it is gone; "
                                     "stopping", master_addr, gone)
                        stop.set()
                        return
                    continue
                if away:
                    logger.info("master %s is back after %.1f s", master_addr,
                                time.monotonic() - last_seen)
                    away = False
                last_seen = time.monotonic()
        finally:
            channel.close()

    thread = threading.Thread(target=run, name="master-watch", daemon=True)
    thread.start()
    return thread
