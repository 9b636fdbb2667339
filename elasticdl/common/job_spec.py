"""The job specification: every flag of a job, validated once, frozen.

CLI flags (and the JSON a master receives) are converted into one
:class:`JobSpec`. Each field's default, help text and constraints live here
and nowhere else; ``elasticdl train --help`` is generated from these fields.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elasticdl.common import resources as res
from elasticdl.common.enums import ClusterKind, JobType, Strategy
from elasticdl.common.reader_params import parse_reader_params
from elasticdl.common.strategy import entry_for

STRATEGIES = tuple(s.value for s in Strategy)
JOB_TYPES = tuple(t.value for t in JobType)
CLUSTERS = tuple(c.value for c in ClusterKind)
DEVICES = ("auto", "cpu", "cuda")
K8S_METRICS_PORT_OFFSET = 1000   # --metrics_port=0 on Kubernetes: the master's port + this


class JobSpecError(ValueError):
    """A flag has a bad value. ``flag`` names it."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"--{flag}: {message}")
        self.flag = flag


def _f(default: Any, help: str, group: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, "group": group, **meta})


@dataclass(frozen=True)
class JobSpec:
    """Everything a job needs; built by :func:`job_spec_from_flags`."""

    # --- what to run
    job_type: JobType = _f("train", "train, evaluate or predict (set by the command)",
                           "job", choices=JOB_TYPES, cli=False)
    job_name: str = _f("", "Job name; default: <model module>-<time>", "job")
    # "" until __post_init__ picks one (k8s when --image_name is given)
    cluster: ClusterKind = _f("", "local or k8s; default k8s when --image_name is given, "
                              "else local", "job", choices=("",) + CLUSTERS)
    distribution_strategy: Strategy = _f("Local", "Local, ParameterServerStrategy or "
                                         "AllreduceStrategy", "job", choices=STRATEGIES)
    # --- model
    model_zoo: str = _f("", "Directory holding the model modules (required)", "model")
    model_def: str = _f("", "module.path.factory of the model, e.g. "
                        "digits.digits_cnn.custom_model (required)", "model")
    model_params: str = _f("", 'Keyword args for the model factory: "k1=v1;k2=v2"', "model")
    loss: str = _f("loss", "Name of the loss function in the model module", "model")
    optimizer: str = _f("optimizer", "Name of the optimizer factory in the model module",
                        "model")
    feed: str = _f("feed", "Name of the records->tensors function in the model module", "model")
    eval_metrics_fn: str = _f("eval_metrics_fn", "Name of the metrics factory", "model")
    custom_data_reader: str = _f("custom_data_reader", "Name of an optional reader factory",
                                 "model")
    prediction_outputs_processor: str = _f("PredictionOutputsProcessor",
                                           "Name of an optional prediction writer class",
                                           "model")
    # --- data
    training_data: str = _f("", "File or directory (or s3://, gs://, hdfs:// URL) of "
                            "training records", "data")
    validation_data: str = _f("", "File or directory (or URL) of validation records", "data")
    prediction_data: str = _f("", "File or directory (or URL) of records to predict", "data")
    data_reader_params: str = _f("", 'Reader options: "sep=|;header=true"', "data")
    data_endpoint: str = _f("", "S3-compatible endpoint URL for s3:// data and checkpoints, "
                            "e.g. http://minio:9000 (default: AWS_ENDPOINT_URL or AWS); "
                            "credentials come from the environment, never a flag "
                            "(docs/data.md)", "data")
    minibatch_size: int = _f(64, "Records per minibatch", "data", min=1)
    eval_minibatch_size: int = _f(0, "Records per minibatch in evaluation and prediction "
                                  "(0: --minibatch_size)", "data", min=0)
    num_minibatches_per_task: int = _f(8, "Minibatches per task (a task is the unit of "
                                       "data sharding)", "data", min=1)
    num_epochs: int = _f(1, "Passes over the training data", "data", min=1)
    shuffle: bool = _f(False, "Shuffle the order of tasks in each epoch", "data")
    seed: int = _f(0, "Seed for task shuffling and model initialisation", "data")
    data_loader_workers: int = _f(0, "Worker processes of the torch DataLoader that loads a "
                                  "model module's dataset(path, mode) (0: in a background "
                                  "thread of the worker)", "data", min=0)
    data_loader_timeout_s: float = _f(120.0, "Longest wait for one minibatch of a module's "
                                      "dataset(path, mode); past it the task fails (and is "
                                      "retried) naming the DataLoader (0: wait forever)",
                                      "data", min=0)
    prediction_output_format: str = _f("npz", "Default prediction writer format: npz or csv",
                                       "data", choices=("npz", "csv"))
    # --- training
    evaluation_steps: int = _f(0, "Evaluate every N model versions (0: only at epoch end)",
                               "training", min=0)
    checkpoint_dir: str = _f("", "Where checkpoints are written (a directory; s3://... "
                             "for Local and --cluster=local jobs, docs/data.md)", "training")
    checkpoint_steps: int = _f(0, "Checkpoint every N model versions (0: never)", "training",
                               min=0)
    keep_checkpoint_max: int = _f(0, "Checkpoints kept (0 keeps all)", "training", min=0)
    full_checkpoint_every: int = _f(
        8, "ParameterServerStrategy: every Nth checkpoint of a PS holds its whole tables, "
        "the others only the rows changed since the previous one (1: always whole)",
        "training", min=1)
    checkpoint_dir_for_init: str = _f("", "Checkpoint (or checkpoint dir) to resume from",
                                      "training")
    ps_recovery: str = _f(
        "alone", "ParameterServerStrategy, a PS lost: alone (it restores its own newest "
        "complete checkpoint, the others keep their state and training, the work it lost "
        "is redone and applied by it only: each PS exact by its ledger, no single "
        "consistent cut across PS) or rollback_all (every PS rolls back to that "
        "checkpoint: one consistent cut, everyone's work since redone); see "
        "docs/parameter_server.md#recovery", "training",
        choices=("alone", "rollback_all"))
    output: str = _f("", "Output directory: final model, predictions, job_report.json",
                     "training")
    device: str = _f("auto", "auto, cpu or cuda (auto picks CUDA when present)", "training",
                     choices=DEVICES)
    log_level: str = _f("INFO", "DEBUG, INFO, WARNING or ERROR", "training",
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    # --- distribution
    num_workers: int = _f(1, "Number of workers, or MIN:MAX (elastic: trains once MIN run, "
                          "asks for MAX; see docs/elastic.md)", "distribution", min=1)
    # --- elastic scheduling (docs/elastic.md); --num_workers=MIN:MAX sets min_workers
    min_workers: int = _f(0, "Workers the job needs to train (0: --num_workers)",
                          "distribution", min=0, cli=False)
    min_workers_timeout_s: float = _f(600.0, "Seconds with fewer than MIN workers running "
                                      "before --on_min_workers_timeout applies", "distribution",
                                      min=1)
    on_min_workers_timeout: str = _f("wait", "wait (log, report and keep waiting) or fail "
                                     "(fail the job naming the scheduler's reason)",
                                     "distribution", choices=("wait", "fail"))
    autoscale: float = _f(0.0, "With --num_workers=MIN:MAX: start at MIN and add a worker "
                          "only while each raises measured throughput by at least this "
                          "fraction of the per-worker rate (0: off; docs/elastic.md)",
                          "distribution", min=0)
    autoscale_window_s: float = _f(20.0, "--autoscale: seconds each size's throughput is "
                                   "measured over (a new size first settles half that)",
                                   "distribution", min=1)
    num_ps_pods: int = _f(1, "Number of parameter servers (ParameterServerStrategy)",
                          "distribution", min=1)
    grads_to_wait: int = _f(1, "Sync PS: pushes averaged per model version", "distribution",
                            min=1)
    use_async: bool = _f(False, "PS applies each gradient push at once", "distribution")
    lr_staleness_modulation: bool = _f(False, "Async PS: scale lr by 1/staleness",
                                       "distribution")
    sync_version_tolerance: int = _f(0, "Sync PS: accept gradients this many versions old",
                                     "distribution", min=0)
    get_model_steps: int = _f(1, "Async PS: pull the model every N steps", "distribution",
                              min=1)
    ps_table_min_elements: int = _f(1_000_000, "ParameterServerStrategy: a torch "
                                    "nn.Embedding or nn.EmbeddingBag with sparse=True or at "
                                    "least this many elements becomes a row-sharded PS table "
                                    "(0: every one; -1: none, and sparse=True ones are "
                                    "refused); see docs/parameter_server.md", "distribution",
                                    min=-1)
    export_sparse_min_elements: int = _f(1 << 24, "ParameterServerStrategy: PS tables of at "
                                         "least this many elements are exported sparse, as "
                                         "the rows that exist, beside model.pt, and read so "
                                         "by evaluate/predict (see docs/parameter_server.md)",
                                         "distribution", min=0)
    # --- admission and eviction of PS table rows (docs/parameter_server.md); a layer's
    #     Embedding(admit_after=, ttl_versions=, max_rows=) wins over these for its table
    embedding_admit_after: int = _f(1, "ParameterServerStrategy: an embedding id gets a PS "
                                    "row only on its Nth training pull; before, it reads "
                                    "the table's default row and its gradients are dropped "
                                    "(1: a row at once)", "distribution", min=1)
    embedding_admission_counters: int = _f(1 << 22, "ParameterServerStrategy: bytes of the "
                                           "admission counting sketch per table and PS "
                                           "(1-byte counters; ~2 per candidate id)",
                                           "distribution", min=64)
    embedding_ttl_versions: int = _f(0, "ParameterServerStrategy: evict an embedding row "
                                     "not updated for this many model versions (0: never)",
                                     "distribution", min=0)
    embedding_ttl_seconds: float = _f(0.0, "ParameterServerStrategy: evict an embedding row "
                                      "not updated for this many seconds (0: never; with "
                                      "--embedding_ttl_versions too, either evicts)",
                                      "distribution", min=0)
    embedding_max_rows: int = _f(0, "ParameterServerStrategy: rows per embedding table, "
                                 "all PS together; beyond, the least recently updated "
                                 "rows are evicted (0: unbounded)", "distribution", min=0)
    embedding_evict_sweep_rows: int = _f(1 << 16, "ParameterServerStrategy: rows of each "
                                         "table the TTL sweep visits per model version",
                                         "distribution", min=1)
    comm_backend: str = _f("", "Allreduce backend: gloo or nccl (default: nccl on CUDA, "
                           "else gloo)", "distribution", choices=("", "gloo", "nccl"))
    fixed_global_batch_size: bool = _f(False, "Allreduce: keep the global batch constant "
                                       "when the world size changes", "distribution")
    collective_timeout_s: float = _f(30.0, "Allreduce: seconds before a stuck collective "
                                     "counts as a failed member", "distribution", min=1)
    relaunch_on_worker_failure: int = _f(3, "Relaunches of a worker that fails on its own "
                                         "(signals/preemption always relaunch)",
                                         "distribution", min=0)
    max_task_retries: int = _f(3, "Attempts of one task before the job fails",
                               "distribution", min=1)
    clip_grad_norm: float = _f(0.0, "Clip gradients to this global L2 norm over all "
                               "parameters and embedding rows of a step (0: off); correct "
                               "across PS shards and allreduce members", "training", min=0)
    amp: str = _f("off", "Mixed precision: off, bf16 (autocast; CPU or CUDA) or fp16 "
                  "(CUDA autocast with a GradScaler)", "training",
                  choices=("off", "bf16", "fp16"))
    skip_nonfinite_steps: bool = _f(False, "Skip (and count in the report) a step whose "
                                    "loss or gradient is NaN/Inf instead of failing its task",
                                    "training")
    on_divergence: str = _f("warn", "What the master does when the training loss the "
                            "workers report (windowed) turns non-finite, rises far above "
                            "its best or never leaves its initial value: warn (the job "
                            "ends succeeded_with_warnings), fail, rollback (PS jobs with "
                            "--checkpoint_dir: every PS back to the newest checkpoint at or "
                            "before the best loss, the learning rate cut by "
                            "--divergence_lr_factor), or off; see "
                            "docs/training.md#training-health", "training",
                            choices=("warn", "fail", "rollback", "off"))
    divergence_lr_factor: float = _f(0.5, "--on_divergence=rollback: each rollback "
                                     "multiplies every learning rate the PS apply by this",
                                     "training")
    divergence_sync: bool = _f(True, "--on_divergence=rollback of an async PS job: after a "
                               "rollback the PS apply pushes synchronously (one version a "
                               "round of the live workers, no stale gradient) for the rest of "
                               "the job; false keeps async (the rate cut only)", "training")
    max_divergence_rollbacks: int = _f(3, "--on_divergence=rollback: the job fails at the "
                                       "verdict after this many rollbacks", "training", min=1)
    health_window_tasks: int = _f(8, "Training tasks per window of the loss health "
                                  "detector (--on_divergence)", "training", min=1)
    export_torchscript: bool = _f(False, "Also export the final model as TorchScript "
                                  "(model_scripted.pt) next to model.pt; a model that does "
                                  "not script gets a warning, never a failed job", "training")
    # --- metric-driven LR schedules and stateful sequence training (docs/training.md)
    lr_plateau: str = _f("", "The module's ReduceLROnPlateau rule and monitored metric, as "
                         "JSON (set by the elasticdl command when it checks the model)",
                         "training", cli=False)
    sequential_tasks: bool = _f(False, "Tasks in data order (refuses --shuffle and "
                                "AllreduceStrategy), for a module with init_state: a model "
                                "state carried across minibatches (truncated BPTT; see "
                                "docs/training.md)", "training")
    task_timeout_s: float = _f(0.0, "Reassign a task held longer than this (0: 3x the "
                               "median task time, at least 60 s)", "distribution", min=0)
    task_lease_s: float = _f(1.0, "Workers whose tasks are short lease about this many "
                             "seconds of tasks per call to the master (at most 16) and send "
                             "their results with the next call (0: one task per call)",
                             "distribution", min=0)
    task_read_ahead: bool = _f(True, "Workers that lease tasks read the next task's records "
                               "while the current one trains (one more task's records in "
                               "memory; false: each task read when it starts)", "data")
    master_reconnect_timeout_s: float = _f(300.0, "Seconds workers and PS keep reconnecting "
                                           "to a master that is gone (restarting) before "
                                           "they exit", "distribution", min=1)
    max_master_restarts: int = _f(3, "Relaunches of a master that dies mid-job (it "
                                  "restores from its journal and adopts the replicas)",
                                  "distribution", min=0)
    master_state_pvc: str = _f("", "Kubernetes: PersistentVolumeClaim holding the master's "
                               "job directory (its journal survives the loss of the master "
                               "pod; without one it survives only container restarts)",
                               "cluster")
    # --- cluster
    image_name: str = _f("", "Docker image of the job (submits to Kubernetes)", "cluster")
    namespace: str = _f("default", "Kubernetes namespace", "cluster")
    image_pull_policy: str = _f("Always", "Always, IfNotPresent or Never", "cluster",
                                choices=("Always", "IfNotPresent", "Never"))
    master_resource_request: str = _f("cpu=0.5,memory=1024Mi", "Master pod resources",
                                      "cluster", kind="resources")
    master_resource_limit: str = _f("", "Master pod limits", "cluster", kind="resources")
    worker_resource_request: str = _f("cpu=1,memory=4096Mi", "Worker pod resources, "
                                      'e.g. "cpu=2,memory=4096Mi,gpu=1"', "cluster",
                                      kind="resources")
    worker_resource_limit: str = _f("", "Worker pod limits", "cluster", kind="resources")
    ps_resource_request: str = _f("cpu=1,memory=4096Mi", "PS pod resources", "cluster",
                                  kind="resources")
    ps_resource_limit: str = _f("", "PS pod limits", "cluster", kind="resources")
    master_pod_priority: str = _f("", "Priority class of the master pod", "cluster")
    worker_pod_priority: str = _f("", "high, low, a priority class, or a fraction (0.5: half "
                                  "the workers high)", "cluster")
    ps_pod_priority: str = _f("", "Priority class of PS pods", "cluster")
    volume: str = _f("", 'Volumes: "host_path=/d,mount_path=/data;claim_name=c,'
                     'mount_path=/m"', "cluster", kind="volume")
    envs: str = _f("", 'Environment of every replica: "A=1,B=2"', "cluster", kind="envs")
    data_secret: str = _f("", "Kubernetes Secret whose keys become environment variables "
                          "of every pod (object-storage credentials: AWS_ACCESS_KEY_ID, "
                          "AWS_SECRET_ACCESS_KEY...); the manifests name it, never its "
                          "values (docs/data.md)", "cluster")
    cluster_spec: str = _f("", "JSON file (or JSON) patched into every pod spec", "cluster")
    yaml: str = _f("", "Write the job's manifests to this file instead of submitting",
                   "cluster")
    metrics_port: int = _f(0, "Port of the master's Prometheus endpoint (/metrics): 0 picks "
                           "a free port (Kubernetes: the master's port + 1000, i.e. 51001), "
                           "-1 turns it off; see docs/observability.md", "cluster", min=-1,
                           max=65535)
    grpc_tls: bool = _f(False, "Encrypt the job's gRPC traffic with TLS (a self-signed "
                        "certificate made for the job, delivered with the job token; see "
                        "docs/security.md)", "cluster")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            choices = f.metadata.get("choices")
            if choices is not None and value not in choices:
                shown = ", ".join(c for c in choices if c) or "(empty)"
                raise JobSpecError(f.name, f"must be one of {shown}, got {value!r}")
            low = f.metadata.get("min")
            if low is not None and value < low:
                raise JobSpecError(f.name, f"must be >= {low}, got {value!r}")
            high = f.metadata.get("max")
            if high is not None and value > high:
                raise JobSpecError(f.name, f"must be <= {high}, got {value!r}")
            kind = f.metadata.get("kind")
            try:
                if kind == "resources":
                    res.parse_resources(value)
                elif kind == "envs":
                    res.parse_envs(value)
                elif kind == "volume":
                    res.parse_volumes(value)
            except ValueError as e:
                raise JobSpecError(f.name, str(e)) from None
        for name, parse in (("model_params", res.parse_params),
                            ("data_reader_params", parse_reader_params)):
            try:
                parse(getattr(self, name))
            except ValueError as e:
                raise JobSpecError(name, str(e)) from None
        if not self.cluster:
            object.__setattr__(self, "cluster", "k8s" if self.image_name else "local")
        for name, kind in (("job_type", JobType), ("cluster", ClusterKind),
                           ("distribution_strategy", Strategy)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        self._check_required()
        if not self.job_name:
            base = self.model_def.rsplit(".", 2)[0].split(".")[-1] if self.model_def else "job"
            name = re.sub(r"[^a-z0-9-]", "-", base.lower()).strip("-") or "job"
            object.__setattr__(self, "job_name", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
        if not re.match(r"^[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?$", self.job_name):
            raise JobSpecError("job_name", "must be lowercase letters, digits and '-', "
                               f"starting and ending alphanumeric, at most 52 chars: "
                               f"{self.job_name!r}")

    def _check_required(self) -> None:
        if not self.model_zoo:
            raise JobSpecError("model_zoo", "is required")
        if not self.model_def:
            raise JobSpecError("model_def", "is required (module.path.factory)")
        if self.model_def.count(".") < 1:
            raise JobSpecError("model_def", f"must be module.factory, got {self.model_def!r}")
        if self.job_type == JobType.TRAIN and not self.training_data:
            raise JobSpecError("training_data", "is required to train")
        if self.job_type == JobType.EVALUATE and not self.validation_data:
            raise JobSpecError("validation_data", "is required to evaluate")
        if self.job_type == JobType.PREDICT and not self.prediction_data:
            raise JobSpecError("prediction_data", "is required to predict")
        if self.job_type in (JobType.EVALUATE, JobType.PREDICT) and \
                not self.checkpoint_dir_for_init:
            raise JobSpecError("checkpoint_dir_for_init",
                               f"is required to {self.job_type} (the model to use)")
        if self.job_type == JobType.PREDICT and not self.output:
            raise JobSpecError("output", "is required to predict (where outputs go)")
        if self.min_workers > self.num_workers:
            raise JobSpecError("num_workers", f"MIN {self.min_workers} is above MAX "
                               f"{self.num_workers}")
        if self.autoscale:
            if self.autoscale > 1:
                raise JobSpecError("autoscale", f"is a fraction in (0, 1], got {self.autoscale}")
            if self.workers_min >= self.num_workers:
                raise JobSpecError("autoscale", "needs a range to size within: "
                                   "--num_workers=MIN:MAX with MIN < MAX")
        for flag in ("checkpoint_dir", "checkpoint_dir_for_init", "output"):
            if "://" in getattr(self, flag) and (flag == "output" or not re.match(
                    r"^(s3|s3a|gs|gcs|hdfs)://[^@\s]+$", getattr(self, flag))):
                raise JobSpecError(flag, "URLs are supported for data and (s3://, gs://, "
                                   "hdfs://) checkpoints only (docs/data.md); use a local "
                                   "or mounted directory")
        if self.data_secret and not re.match(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$",
                                             self.data_secret):
            raise JobSpecError("data_secret", f"is not a Secret name: {self.data_secret!r}")
        if self.data_endpoint and not re.match(r"^https?://[^/@\s]+(/\S*)?$",
                                               self.data_endpoint):
            raise JobSpecError("data_endpoint", "must be an http(s):// URL without "
                               "credentials, e.g. http://minio:9000")
        if self.sequential_tasks and self.shuffle:
            raise JobSpecError("sequential_tasks", "keeps tasks in data order: drop --shuffle")
        if self.on_divergence == "rollback" and self.job_type == JobType.TRAIN and (
                self.distribution_strategy != Strategy.PS or
                not self.checkpoint_dir or self.checkpoint_steps <= 0):
            raise JobSpecError("on_divergence", "rollback needs ParameterServerStrategy with "
                               "--checkpoint_dir and --checkpoint_steps (the PS roll back to "
                               "a checkpoint); use warn or fail")
        if not 0.0 < self.divergence_lr_factor <= 1.0:
            raise JobSpecError("divergence_lr_factor", f"must be in (0, 1], got "
                               f"{self.divergence_lr_factor}")
        if self.sequential_tasks and self.distribution_strategy == Strategy.ALLREDUCE:
            raise JobSpecError("sequential_tasks", "AllreduceStrategy does not carry a model "
                               "state; use Local or ParameterServerStrategy")
        strategy = entry_for(self.distribution_strategy)
        if self.job_type == JobType.TRAIN and strategy.in_process_training and \
                self.num_workers > 1:
            raise JobSpecError("num_workers", "Local strategy trains in one process; use "
                               "ParameterServerStrategy or AllreduceStrategy for "
                               f"{self.num_workers} workers")
        if self.use_async and not strategy.supports_async:
            raise JobSpecError("use_async", "only applies to ParameterServerStrategy")

    # ------------------------------------------------------------- helpers
    def master_metrics_port(self, master_port: int) -> int:
        """The port of the master's /metrics: -1 off, 0 a free one (local); on
        Kubernetes 0 is ``master_port`` + 1000 (its Service names a fixed port)."""
        if self.metrics_port == 0 and self.cluster == ClusterKind.K8S:
            return master_port + K8S_METRICS_PORT_OFFSET
        return self.metrics_port

    @property
    def workers_min(self) -> int:
        """Workers the job needs running to train (MIN of --num_workers=MIN:MAX)."""
        return self.min_workers or self.num_workers

    @property
    def initial_workers(self) -> int:
        """Workers the job launches at start: MIN with --autoscale, else MAX."""
        return self.workers_min if self.autoscale else self.num_workers

    @property
    def records_per_task(self) -> int:
        return self.minibatch_size * self.num_minibatches_per_task

    @property
    def model_kwargs(self) -> dict[str, object]:
        return res.parse_params(self.model_params)

    @property
    def reader_params(self) -> dict[str, str]:
        return parse_reader_params(self.data_reader_params)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise JobSpecError(sorted(unknown)[0], "unknown field in job spec JSON")
        return cls(**data)

    def replace(self, **changes: Any) -> JobSpec:
        return dataclasses.replace(self, **changes)


def cli_fields() -> list[dataclasses.Field]:
    """The JobSpec fields that are command-line flags."""
    return [f for f in dataclasses.fields(JobSpec) if f.metadata.get("cli", True)]


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    """Turn what python-fire parsed into the field's type, or raise JobSpecError."""
    typ = f.type if isinstance(f.type, str) else f.type.__name__
    if typ == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise JobSpecError(f.name, f"expects true or false, got {value!r}")
    if typ == "int":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise JobSpecError(f.name, f"expects an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise JobSpecError(f.name, f"expects an integer, got {value!r}") from None
    if typ == "float":
        if isinstance(value, bool):
            raise JobSpecError(f.name, f"expects a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise JobSpecError(f.name, f"expects a number, got {value!r}") from None
    # str: fire turns "1,2" into a tuple and "007" into 7; undo that
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    if isinstance(value, bool):
        raise JobSpecError(f.name, f"needs a value (--{f.name}=VALUE)")
    return str(value)


def job_spec_from_flags(job_type: str, flags: Mapping[str, Any]) -> JobSpec:
    """Build a JobSpec from parsed CLI flags; raises JobSpecError naming the bad flag."""
    by_name = {f.name: f for f in cli_fields()}
    values: dict[str, Any] = {"job_type": job_type}
    for name, value in flags.items():
        key = name.replace("-", "_")
        if key not in by_name:
            raise JobSpecError(key, "unknown flag (see --help)")
        if key == "num_workers" and isinstance(value, str) and ":" in value:
            values["min_workers"], values[key] = parse_worker_range(value)
            continue
        values[key] = _coerce(by_name[key], value)
    return JobSpec(**values)


def parse_worker_range(text: str) -> tuple[int, int]:
    """``"MIN:MAX"`` (or ``"N"``) -> ``(min, max)``; raises JobSpecError naming
    --num_workers for anything else (MIN >= 1, MAX >= MIN)."""
    parts = str(text).strip().split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        low, high = 0, -1
    if len(parts) > 2 or low < 1 or high < low:
        raise JobSpecError("num_workers", f"expects N or MIN:MAX with 1 <= MIN <= MAX, got "
                           f"{text!r}")
    return low, high
