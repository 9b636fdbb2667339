"""Was a deleted pod preempted? The scheduler's ``Preempted`` Event says so.

kube-scheduler (v1.20 here) deletes each victim of a preemption and records an
Event ``reason=Preempted``, ``Preempted by <ns>/<pod> on node <node>`` on it;
it sets no ``DisruptionTarget`` condition (that came in 1.26). The Event is
written asynchronously, shortly after the delete, so a lookup polls for up to
10 s before it concludes "a plain delete". With 3 s, a CI run (the whole suite beside
the real-cluster tier, a loaded machine) reported a worker of the preemption test as
"deleted", most likely an Event that came later (the run kept no master log to tell).
A plain delete is relaunched that much later.
Needs ``list`` on ``events`` in the job's namespace (``elasticdl rbac`` grants it).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from kubernetes import client

from elasticdl.cluster.k8s_api import API_ERRORS, REQUEST_TIMEOUT, short_error

logger = logging.getLogger(__name__)


def preemption_message(core: client.CoreV1Api, namespace: str, uid: str,
                       wait_s: float = 10.0, poll_s: float = 0.3) -> str:
    """The message of the ``Preempted`` Event of pod ``uid``, or "" when none
    appears within ``wait_s`` (or events cannot be read: logged)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            resp = core.list_namespaced_event(namespace,
                                              field_selector=f"involvedObject.uid={uid}",
                                              _request_timeout=REQUEST_TIMEOUT,
                                              _preload_content=False)
            items: list[dict[str, Any]] = json.loads(resp.data).get(  # type: ignore[attr-defined]
                "items") or []
        except API_ERRORS as e:
            logger.warning("cannot read the events of pod %s (%s): a preemption is reported "
                           "as a plain delete", uid, short_error(e))
            return ""
        for ev in items:
            if ev.get("reason") == "Preempted":
                return str(ev.get("message") or "Preempted")
        if time.monotonic() >= deadline:
            logger.info("no Preempted event for pod %s within %.0f s: a plain delete", uid,
                        wait_s)
            return ""
        time.sleep(poll_s)
