"""Was a deleted pod preempted? The scheduler's ``Preempted`` Event says so.

kube-scheduler (v1.20 here) deletes each victim of a preemption and records an
Event ``reason=Preempted``, ``Preempted by <ns>/<pod> on node <node>`` on it;
it sets no ``DisruptionTarget`` condition (that came in 1.26). The Event is
written asynchronously, shortly after the delete, so a lookup polls for a few
seconds before it concludes "a plain delete". Needs ``list`` on ``events`` in
the job's namespace (``elasticdl rbac`` grants it).
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
                       wait_s: float = 3.0, poll_s: float = 0.3) -> str:
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
            return ""
        time.sleep(poll_s)
