"""`elasticdl status` figures: the same lines from a live scrape of a real
metrics server and from the job report; the Kubernetes path through the API
server's service proxy (a stand-in core returning a real scrape), and the
fallbacks when the endpoint is gone."""

from __future__ import annotations

import json
import os
import re
import urllib.request

from kubernetes.client.exceptions import ApiException

from elasticdl.master import observability
from elasticdl_client import job_figures, k8s
from tests.unit.master.test_observability import make_core, run_job


def finished_core():
    core = make_core()
    obs = observability.attach(core, "", metrics_port=0, track_ps=True)
    core.notify("on_replica", kind="ps", index=0, alive=True)
    run_job(core, [])
    core.report.add_relaunch("worker-0", "worker-2", "killed", -9)
    core.report.add_relaunch("worker-2", "worker-3", "killed", -9)
    return core, obs


def test_live_and_report_figures_agree():
    core, obs = finished_core()
    try:
        live = job_figures.from_metrics(job_figures.scrape(obs.address))
    finally:
        obs.close()
    report = core.refresh_report().to_dict()
    ended = job_figures.from_report(report)
    assert live[0] == ended[0] == f"  model version {core.version}"
    epochs = [ln for ln in live if ln.startswith("  epoch ")]
    assert epochs == [ln for ln in ended if ln.startswith("  epoch ")] == [
        "  epoch 0: 120/120 records (100.0%), 0 redone",
        "  epoch 1: 120/120 records (100.0%), 0 redone"]
    relaunch = "  relaunches: worker killed x2"
    assert relaunch in live and relaunch in ended
    last = report["evaluations"][-1]
    evaluation = (f"  last evaluation (model version {last['model_version']}): "
                  f"accuracy={last['metrics']['accuracy']:.4f}")
    assert evaluation in live and evaluation in ended
    assert "  tasks: evaluation 0 todo/0 doing/4 done; training 0 todo/0 doing/12 done" in live
    assert "  alive: workers 0/2, PS 1/1" in live
    assert any(ln.startswith("  training: loss 0.0833333, learning rate 0.7, ")
               for ln in live), live
    assert any(ln.startswith("  training: loss ") and "(epoch 1 mean)" in ln
               for ln in ended), ended


def test_a_dead_endpoint_falls_back_to_the_report(tmp_path):
    core, obs = finished_core()
    observability.publish(obs, str(tmp_path), core.report)
    assert json.load(open(tmp_path / observability.METRICS_FILE))["address"] == obs.address
    assert core.report.extra["metrics_endpoint"] == obs.address
    report = core.refresh_report().to_dict()
    source, lines = job_figures.figures(str(tmp_path), report, live=True)
    assert source.startswith("live from http://")
    obs.close()
    source, lines = job_figures.figures(str(tmp_path), report, live=True)
    assert source.startswith("from job_report.json (metrics endpoint ")
    assert lines == job_figures.from_report(report)
    assert job_figures.figures(str(tmp_path), report, live=False)[0] == "from job_report.json"
    os.unlink(tmp_path / observability.METRICS_FILE)
    assert job_figures.endpoint_of(str(tmp_path)) is None


class ProxyCore:
    """What k8s.live_figures calls on a CoreV1Api: the service proxy GET."""

    def __init__(self, address=None, error=None):
        self.address, self.error, self.calls = address, error, []

    def connect_get_namespaced_service_proxy_with_path(self, name, namespace, path):
        self.calls.append((name, namespace, path))
        if self.error is not None:
            raise self.error
        with urllib.request.urlopen(f"http://{self.address}/{path}", timeout=10) as r:
            return r.read().decode()


def test_kubernetes_status_reads_metrics_through_the_service_proxy():
    core, obs = finished_core()
    try:
        proxy = ProxyCore(obs.address)
        lines = k8s.live_figures(proxy, "c1", "ml")
        direct = job_figures.from_metrics(job_figures.scrape(obs.address))
    finally:
        obs.close()
    assert proxy.calls == [("c1-master:metrics", "ml", "metrics")]
    assert lines[0].startswith("figures (live")
    def no_rate(ls):  # records/s moves between two scrapes
        return [re.sub(r", [0-9.?]+ records/s", "", ln) for ln in ls]
    assert no_rate(lines[1:]) == no_rate(direct)
    denied = k8s.live_figures(ProxyCore(error=ApiException(status=403, reason="Forbidden")),
                              "c1", "ml")
    assert denied == ["figures: master metrics endpoint unavailable (Forbidden)"]
