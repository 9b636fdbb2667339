"""A test Job controller for the stand-in API server: the part of the
kube-controller-manager's ``batch/v1`` Job controller that master failover uses.

For each Job it keeps one pod from the template running (``parallelism`` 1,
``completions`` 1): it creates ``<job>-<5 chars>`` with the template's labels plus
``controller-uid``/``job-name`` and a controller owner reference to the Job (so the
stand-in's garbage collector deletes the pods with the Job); a pod that is deleted
is replaced without counting; a Failed pod counts against ``backoffLimit``, and
once more pods failed than that the Job gets the ``Failed`` condition
(``BackoffLimitExceeded``); a Succeeded pod completes the Job. As the real one, it
releases pods whose *controller* reference names the Job but that do not match
its selector, and leaves other pods the Job owns (the replicas) alone. The genuine control plane
tier runs the real controller instead.
"""

from __future__ import annotations

import copy
import logging
import threading
import uuid
from typing import Any

from tests.k8s.apiserver import FakeApiServer, now

logger = logging.getLogger(__name__)


class FakeJobController:
    """Reconciles every Job of ``api`` every ``period_s`` on a daemon thread."""

    def __init__(self, api: FakeApiServer, period_s: float = 0.05):
        self.api = api
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-job-controller",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            for job in self.api.list("jobs"):
                self._reconcile(job)

    def _reconcile(self, job: dict[str, Any]) -> None:
        meta, spec = job["metadata"], job["spec"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        if any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
               for c in (job.get("status") or {}).get("conditions") or []):
            return
        self._release_foreign_pods(ns, uid)
        pods = self.api.list("pods", ns, f"controller-uid={uid}")
        phases = [p["status"].get("phase") for p in pods]
        failed, succeeded = phases.count("Failed"), phases.count("Succeeded")
        active = [p for p in pods if p["status"].get("phase") not in ("Failed", "Succeeded")]
        status: dict[str, Any] = {"active": len(active), "failed": failed,
                                  "succeeded": succeeded}
        if succeeded:
            status["conditions"] = [{"type": "Complete", "status": "True",
                                     "lastTransitionTime": now()}]
        elif failed > int(spec.get("backoffLimit", 6)):
            status["conditions"] = [{"type": "Failed", "status": "True",
                                     "reason": "BackoffLimitExceeded",
                                     "message": "Job has reached the specified backoff limit",
                                     "lastTransitionTime": now()}]
            for pod in active:
                self.api.delete("pods", ns, pod["metadata"]["name"])
        elif not active:
            self._create_pod(job)
            status["active"] = 1
        if status != {k: (job.get("status") or {}).get(k) for k in status}:
            self.api.patch("jobs", ns, name, {"status": status}, status_only=True)

    def _release_foreign_pods(self, ns: str, uid: str) -> None:
        """As the real controller's ControllerRefManager: a pod whose *controller*
        reference names this Job but whose labels do not match its selector is
        released (the reference is removed)."""
        for pod in self.api.list("pods", ns):
            refs = pod["metadata"].get("ownerReferences") or []
            mine = [r for r in refs if r.get("uid") == uid and r.get("controller")]
            if mine and (pod["metadata"].get("labels") or {}).get("controller-uid") != uid:
                kept = [r for r in refs if r not in mine]
                self.api.patch("pods", ns, pod["metadata"]["name"],
                               {"metadata": {"ownerReferences": kept or None}},
                               status_only=False)

    def _create_pod(self, job: dict[str, Any]) -> None:
        meta, template = job["metadata"], job["spec"]["template"]
        pod_meta = copy.deepcopy(template.get("metadata") or {})
        pod_meta["name"] = f"{meta['name']}-{uuid.uuid4().hex[:5]}"
        pod_meta.setdefault("labels", {}).update(
            {"controller-uid": meta["uid"], "job-name": meta["name"]})
        pod_meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job",
                                        "name": meta["name"], "uid": meta["uid"],
                                        "controller": True, "blockOwnerDeletion": True}]
        code, body = self.api.create("pods", meta["namespace"],
                                     {"metadata": pod_meta,
                                      "spec": copy.deepcopy(template["spec"])})
        if code != 201:
            logger.error("job %s: cannot create its pod: %s", meta["name"], body)
        else:
            logger.info("job %s: created pod %s", meta["name"], pod_meta["name"])
