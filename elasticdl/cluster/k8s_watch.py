"""Watching one job's pods: list, then watch from the list's resourceVersion.

:class:`PodWatcher` runs one daemon thread. After a dropped connection it
resumes from the last ``resourceVersion`` seen; after ``410 Gone`` (the version
was compacted away) it lists again and hands the set of pod uids listed to
``on_listed``, so the owner can reconcile pods deleted while nobody watched.
Every pod seen goes to ``on_pod(pod, deleted)``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Optional

from kubernetes import client, watch

from elasticdl.cluster.api import ClusterError
from elasticdl.cluster.k8s_api import (
    API_ERRORS,
    REQUEST_TIMEOUT,
    api_error,
    is_status,
    list_pods,
    short_error,
)
from elasticdl.cluster.pod_status import Pod

logger = logging.getLogger(__name__)


class PodWatcher:
    """Delivers every change of the pods matching ``selector`` in ``namespace``."""

    def __init__(self, core: client.CoreV1Api, namespace: str, selector: str,
                 timeout_s: int, on_pod: Callable[[Pod, bool], None],
                 on_listed: Callable[[set[str]], None]):
        self._core = core
        self.namespace = namespace
        self._selector = selector
        self._timeout_s = timeout_s
        self._on_pod = on_pod
        self._on_listed = on_listed
        self._stop = threading.Event()
        self._watch: Optional[watch.Watch] = None
        self._rv = ""
        self._thread: Optional[threading.Thread] = None

    def relist(self) -> str:
        """List the pods, deliver each, reconcile; return the list's resourceVersion.

        Raises:
            ClusterError: the pods cannot be listed (PermissionDenied for 403).
        """
        try:
            pods, rv = list_pods(self._core, self.namespace, self._selector)
        except API_ERRORS as e:
            raise api_error(e, f"list pods in namespace {self.namespace}") from None
        seen = set()
        for pod in pods:
            seen.add(pod["metadata"]["uid"])
            self._on_pod(pod, False)
        self._on_listed(seen)
        return rv

    def start(self, rv: str) -> None:
        """Watch from ``rv`` (a :meth:`relist` result) on a daemon thread."""
        self._thread = threading.Thread(target=self._loop, args=(rv,),
                                        name="k8s-pod-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop watching; waits at most ``timeout_s`` for the thread to end."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        while self._thread is not None and self._thread.is_alive() and \
                time.monotonic() < deadline:
            current = self._watch  # stop() only cuts a stream that has begun: repeat
            if current is not None:
                current.stop()
            self._thread.join(timeout=0.05)

    def _loop(self, rv: str) -> None:
        """Watch from the last resourceVersion seen, until stopped."""
        self._rv = rv
        backoff = 0.1
        while not self._stop.is_set():
            try:
                if not self._rv:
                    self._rv = self.relist()
                self._watch_once()
                backoff = 0.1
            except API_ERRORS as e:
                if self._stop.is_set():
                    break
                if is_status(e, 410):
                    logger.info("watch expired at resourceVersion %s; listing again", self._rv)
                    self._rv = ""
                    continue
                logger.warning("pod watch interrupted (%s); resuming from resourceVersion %s "
                               "in %.1f s", short_error(e), self._rv or "(list)", backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            except ClusterError as e:
                logger.error("%s; retrying in %.1f s", e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            except Exception:  # noqa: BLE001 - a dead watch would hang the master silently
                logger.exception("pod watch failed unexpectedly; listing again in %.1f s",
                                 backoff)
                self._rv = ""
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def _watch_once(self) -> None:
        """One watch request; ``self._rv`` follows every event (resume point)."""
        w = watch.Watch(return_type="object")  # events as the API sent them (dicts)
        self._watch = w
        if self._stop.is_set():
            return
        for event in w.stream(self._core.list_namespaced_pod, self.namespace,
                              label_selector=self._selector, resource_version=self._rv,
                              allow_watch_bookmarks=True,
                              timeout_seconds=self._timeout_s,
                              _request_timeout=(REQUEST_TIMEOUT[0], self._timeout_s + 10)):
            if not event:  # a blank keep-alive line: the client yields None for it
                continue
            pod = event["raw_object"]
            self._rv = str(((pod or {}).get("metadata") or {}).get("resourceVersion")
                           or self._rv)
            if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                self._on_pod(pod, event["type"] == "DELETED")
            if self._stop.is_set():
                w.stop()
