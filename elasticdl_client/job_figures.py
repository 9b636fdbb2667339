"""The figures ``elasticdl status`` shows: from the master's Prometheus endpoint
while the job runs (``metrics_endpoint.json`` in the job directory says where),
from ``job_report.json`` once it ended (or when the endpoint cannot be reached).

Both give the same lines (see docs/observability.md): model version, per epoch
records done of the dataset, task states (live only), replicas alive (live
only), relaunches by reason, the last evaluation's metrics, and training loss,
learning rate and records per second.
"""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any, Optional

from prometheus_client.parser import text_string_to_metric_families

METRICS_FILE = "metrics_endpoint.json"   # elasticdl.master.observability.METRICS_FILE

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(address: str, timeout_s: float = 3.0) -> Samples:
    """``/metrics`` of ``address`` (host:port) as ``{sample name: {labels: value}}``.
    Raises OSError (URLError) when it cannot be reached, ValueError on bad text."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as r:
        return parse(r.read().decode("utf-8"))


def parse(text: str) -> Samples:
    """Prometheus text as ``{sample name: {sorted label pairs: value}}``; raises
    ValueError on text that is not the exposition format."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def endpoint_of(job_dir: str) -> Optional[str]:
    """The address the job's master serves /metrics on, if it published one."""
    try:
        with open(os.path.join(job_dir, METRICS_FILE)) as f:
            return str(json.load(f)["address"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _one(samples: Samples, name: str) -> Optional[float]:
    values = samples.get(name, {})
    return values.get((), None)


def _num(value: Optional[float], fmt: str = "{:.6g}") -> str:
    return "?" if value is None else fmt.format(value)


def _epoch_line(epoch: int, done: float, total: float, redone: float) -> str:
    pct = 100.0 * done / total if total else 0.0
    return (f"  epoch {epoch}: {int(done)}/{int(total)} records ({pct:.1f}%), "
            f"{int(redone)} redone")


def _relaunch_line(by: dict[tuple[str, str], int]) -> str:
    parts = [f"{typ} {reason} x{n}" for (typ, reason), n in sorted(by.items())]
    return "  relaunches: " + (", ".join(parts) if parts else "none")


def _metrics_text(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()))


def from_metrics(samples: Samples) -> list[str]:
    """The status lines from a scrape of the live master."""
    lines = [f"  model version {_num(_one(samples, 'elasticdl_model_version'), '{:.0f}')}"]
    total = _one(samples, "elasticdl_epoch_records") or 0.0
    redone = {dict(k).get("epoch"): v for k, v in
              samples.get("elasticdl_epoch_records_redone", {}).items()}
    for key, done in sorted(samples.get("elasticdl_epoch_records_completed", {}).items(),
                            key=lambda kv: int(dict(kv[0])["epoch"])):
        epoch = dict(key)["epoch"]
        lines.append(_epoch_line(int(epoch), done, total, redone.get(epoch, 0.0)))
    tasks: dict[str, dict[str, int]] = {}
    for key, n in samples.get("elasticdl_tasks", {}).items():
        labels = dict(key)
        tasks.setdefault(labels["type"], {})[labels["state"]] = int(n)
    parts = [f"{typ} {s.get('todo', 0)} todo/{s.get('doing', 0)} doing/{s.get('done', 0)} "
             "done" for typ, s in sorted(tasks.items()) if any(s.values())]
    lines.append("  tasks: " + ("; ".join(parts) or "none"))
    alive = [f"workers {_num(_one(samples, 'elasticdl_workers_alive'), '{:.0f}')}/"
             f"{_num(_one(samples, 'elasticdl_workers_requested'), '{:.0f}')}"]
    if "elasticdl_ps_alive" in samples and (_one(samples, "elasticdl_ps_requested") or 0):
        alive.append(f"PS {_num(_one(samples, 'elasticdl_ps_alive'), '{:.0f}')}/"
                     f"{_num(_one(samples, 'elasticdl_ps_requested'), '{:.0f}')}")
    lines.append("  alive: " + ", ".join(alive))
    by = {(dict(k)["replica_type"], dict(k)["reason"]): int(v)
          for k, v in samples.get("elasticdl_relaunches_total", {}).items()}
    lines.append(_relaunch_line(by))
    version = _one(samples, "elasticdl_evaluation_model_version")
    metrics = {dict(k)["metric"]: v for k, v in
               samples.get("elasticdl_evaluation_metric", {}).items()}
    if version is not None:
        lines.append(f"  last evaluation (model version {version:.0f}): "
                     f"{_metrics_text(metrics)}")
    lines.append(f"  training: loss {_num(_one(samples, 'elasticdl_training_loss'))}, "
                 f"learning rate {_num(_one(samples, 'elasticdl_learning_rate'))}, "
                 f"{_num(_one(samples, 'elasticdl_training_records_per_second'), '{:.1f}')}"
                 " records/s")
    return lines


def from_report(report: dict[str, Any]) -> list[str]:
    """The same lines from ``job_report.json`` (no task states or replicas alive:
    those describe a running job)."""
    lines = [f"  model version {report.get('model_version', '?')}"]
    total = report.get("dataset", {}).get("training_records", 0)
    for e in report.get("epochs", []):
        lines.append(_epoch_line(e["epoch"], e["records_completed"], total,
                                 e.get("records_redone", 0)))
    by: dict[tuple[str, str], int] = {}
    for r in report.get("relaunches", []):
        key = (str(r["replica"]).rsplit("-", 1)[0], str(r["reason"]))
        by[key] = by.get(key, 0) + 1
    lines.append(_relaunch_line(by))
    evaluations = report.get("evaluations", [])
    if evaluations:
        last = evaluations[-1]
        lines.append(f"  last evaluation (model version {last['model_version']}): "
                     f"{_metrics_text(last['metrics'])}")
    training = [t for t in report.get("training", []) if t.get("mean_loss") is not None]
    if training:
        t = training[-1]
        lrs = [(t.get("learning_rate") or {}).get("last")] if t.get("learning_rate") else \
            t.get("learning_rates") or [None]
        rate = report.get("timings", {}).get("training_records_per_s")
        lines.append(f"  training: loss {_num(t['mean_loss'])} (epoch {t['epoch']} mean), "
                     f"learning rate {_num(lrs[-1])}, {_num(rate, '{:.1f}')} records/s "
                     "(job mean)")
    return lines


def figures(job_dir: str, report: dict[str, Any], live: bool) -> tuple[str, list[str]]:
    """``(source, lines)``: from the live endpoint when ``live`` and it answers,
    else from the report."""
    address = endpoint_of(job_dir) if live else None
    if address:
        try:
            return f"live from http://{address}/metrics", from_metrics(scrape(address))
        except (OSError, ValueError) as e:
            source = f"from job_report.json (metrics endpoint {address}: {e})"
            return source, from_report(report)
    return "from job_report.json", from_report(report)
