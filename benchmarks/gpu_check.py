"""One-shot CUDA check of the product's GPU paths, for a lent GPU machine.

Runs, each bounded by a timeout and independent of the others (a failure is
recorded and the next step runs):

  env        torch / CUDA / NCCL versions, the GPU's name
  pytest_*   the CUDA-gated unit tests (-k cuda), the ``gpu``-marked integration
             tests (they need 2 GPUs, so they skip on one), and the CUDA-aware
             unit files (backend choice, launch checks)
  ps_*       real distributed jobs through the CLI (--cluster=local), PS strategy
  allreduce  AllreduceStrategy: 1 worker (NCCL world size 1 on one GPU), amp off
             and fp16, and 2 workers over gloo (CUDA tensors, one GPU)
  local_amp  Local strategy with --amp=off, fp16 and bf16
  bench      benchmarks/local_overhead.py --device (framework vs plain loop)

Each job trains a copy of ``digits.digits_cnn`` whose ``loss`` writes, once per
process, where it ran (device and dtype of the outputs, autocast on or off):
that, not the flags, is what says a worker trained on CUDA.  On a machine
without CUDA the jobs run with --device=cpu and fp16 AMP is expected to be
refused (a dry run of this script's own logic).

    python benchmarks/gpu_check.py --out DIR [--deadline 370] [--quick] [--only a,b] [--smoke]

(exit 1 when a step failed; ``--smoke``: the test suite's run, the env step and one
short Local job, on CPU where there is no CUDA)

Writes DIR/summary.json (rewritten after every step), DIR/steps.log (each
step's command and output tail), DIR/job_logs.tar.gz (every job's logs/ and
job_report.json) and DIR/bench.txt.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable

DEVCHECK = '''"""digits.digits_cnn, plus a record of where training ran (gpu_check.py)."""
import json, os
import torch
from digits.digits_cnn import custom_model, optimizer, feed, eval_metrics_fn  # noqa: F401
from digits import digits_cnn as _base

_MARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "marks")
_done = [False]


def loss(labels, outputs):
    if not _done[0] and torch.is_grad_enabled():
        _done[0] = True
        os.makedirs(_MARKS, exist_ok=True)
        rec = {"pid": os.getpid(), "device": str(outputs.device), "dtype": str(outputs.dtype),
               "autocast": torch.is_autocast_enabled(outputs.device.type),
               "labels_device": str(labels.device)}
        with open(os.path.join(_MARKS, f"{os.getpid()}.json"), "w") as f:
            json.dump(rec, f)
    return _base.loss(labels, outputs)
'''


class Checker:
    def __init__(self, out: str, deadline_s: float, quick: bool, only: str = ""):
        self.out = out
        self.only = {x for x in only.split(",") if x}
        self.t0 = time.monotonic()
        self.deadline = deadline_s
        self.quick = quick
        self.slack = 1.0   # x each step's timeout (--smoke: the suite's loaded machine)
        self.results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": {}}
        self.work = tempfile.mkdtemp(prefix="gpu_check_")
        self.home = os.path.join(self.work, "edl_home")
        self.jobs_dir = os.path.join(self.work, "jobs")
        os.makedirs(self.jobs_dir)
        self.zoo = self._make_zoo()
        self.log = open(os.path.join(out, "steps.log"), "w")
        import torch

        self.cuda = torch.cuda.is_available()
        self.device = "cuda" if self.cuda else "cpu"

    # ---------------------------------------------------------------- plumbing
    def _make_zoo(self) -> str:
        zoo = os.path.join(self.work, "zoo")
        for pkg in ("digits", "mnist"):
            shutil.copytree(os.path.join(ROOT, "model_zoo", pkg), os.path.join(zoo, pkg))
        dc = os.path.join(zoo, "devcheck")
        os.makedirs(dc)
        open(os.path.join(dc, "__init__.py"), "w").close()
        with open(os.path.join(dc, "digits_dev.py"), "w") as f:
            f.write(DEVCHECK)
        return zoo

    def left(self) -> float:
        return self.deadline - (time.monotonic() - self.t0)

    def save(self) -> None:
        self.results["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(self.results, f, indent=1, default=str)

    def record(self, name: str, ok, **info) -> None:
        status = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
        info["status"] = status
        self.results["steps"][name] = info
        brief = {k: v for k, v in info.items() if k not in ("status", "tail", "cmd")}
        print(f"=== {status} {name}: {json.dumps(brief, default=str)[:900]}", flush=True)
        self.save()

    def sh(self, cmd: list[str], timeout: float, env: dict | None = None,
           cwd: str = ROOT) -> tuple[int, str, float]:
        """Run ``cmd`` in its own session; on timeout SIGTERM (the client then stops
        its job), then SIGKILL the group. Returns (rc, output, seconds); rc 124 on timeout."""
        timeout = max(5.0, min(timeout * self.slack, self.left()))
        e = dict(os.environ, ELASTICDL_HOME=self.home, PYTHONUNBUFFERED="1")
        e["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), ROOT) if p)
        e.update(env or {})
        t = time.monotonic()
        p = subprocess.Popen(cmd, cwd=cwd, env=e, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                out, _ = p.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out, _ = p.communicate()
            rc = 124
        dt = time.monotonic() - t
        self.log.write(f"\n######## rc={rc} {dt:.1f}s: {' '.join(cmd)}\n{out[-20000:]}\n")
        self.log.flush()
        return rc, out, dt

    # ---------------------------------------------------------------- steps
    def env(self) -> None:
        import torch

        info = {"torch": torch.__version__, "cuda_available": self.cuda, "python": sys.version}
        if self.cuda:
            info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                        nccl=".".join(map(str, torch.cuda.nccl.version())),
                        gpus=torch.cuda.device_count())
        for mod in ("grpc", "google.protobuf", "fire", "numpy"):
            try:
                m = __import__(mod, fromlist=["__version__"])
                info[mod] = getattr(m, "__version__", "?")
            except Exception as e:  # noqa: BLE001
                info[mod] = f"MISSING {e}"
        try:
            import elasticdl.proto.elasticdl_pb2_grpc  # noqa: F401

            info["stubs"] = "ok"
        except Exception as e:  # noqa: BLE001
            info["stubs"] = f"{type(e).__name__}: {e}"
        self.record("env", info["stubs"] == "ok" and not str(info["fire"]).startswith("MISS"),
                    **info)

    def pytest(self, name: str, args: list[str], timeout: float, want_pass: bool) -> None:
        cmd = [PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args]
        rc, out, dt = self.sh(cmd, timeout)
        lines = [ln for ln in out.splitlines() if ln.strip()]
        summary = lines[-1] if lines else ""
        passed = "passed" in summary and "failed" not in summary and "error" not in summary
        # rc 5: nothing collected/selected; all skipped counts as ok unless we want passes
        ok = rc == 0 and (passed or not want_pass) or (rc == 5 and not want_pass)
        skips = [ln for ln in lines if ln.startswith("SKIPPED")]
        self.record(name, ok, rc=rc, seconds=round(dt, 1), summary=summary, skipped=skips[:6],
                    cmd=" ".join(cmd), tail=out[-3000:] if not ok else "")
        with open(os.path.join(self.out, "pytest.txt"), "a") as f:
            f.write(f"######## {name} rc={rc}: {' '.join(cmd)}\n{out[-15000:]}\n")

    def job(self, name: str, flags: list[str], timeout: float, expect_ok: bool = True,
            check_backend: str = "", expect_dtype: str = "") -> dict:
        out_dir = os.path.join(self.jobs_dir, name)
        marks = os.path.join(self.zoo, "devcheck", "marks")
        shutil.rmtree(marks, ignore_errors=True)
        cmd = [PY, "-m", "elasticdl_client.main", "train", f"--model_zoo={self.zoo}",
               "--model_def=devcheck.digits_dev.custom_model",
               f"--training_data={ROOT}/data/digits/train",
               f"--validation_data={ROOT}/data/digits/val",
               f"--output={out_dir}", f"--job_name=gc-{name.replace('_', '-')}", *flags]
        rc, out, dt = self.sh(cmd, timeout)
        info: dict = {"rc": rc, "seconds": round(dt, 1), "cmd": " ".join(cmd)}
        rep_path = os.path.join(out_dir, "job_report.json")
        rep = json.load(open(rep_path)) if os.path.exists(rep_path) else {}
        info["report_status"] = rep.get("status")
        info["final_metrics"] = rep.get("final_metrics")
        info["mean_loss_per_epoch"] = [round(t.get("mean_loss") or float("nan"), 4)
                                       for t in rep.get("training", [])]
        eps = [e.get("records_per_s") for e in rep.get("epochs", []) if e.get("records_per_s")]
        info["records_per_s_epochs_median"] = statistics.median(eps) if eps else None
        info["training_records_per_s"] = (rep.get("timings") or {}).get("training_records_per_s")
        info["wall_s"] = (rep.get("timings") or {}).get("wall_s")
        info["records_applied_ok"] = all(e.get("records_applied") in (None, e.get(
            "records_completed")) for e in rep.get("epochs", []))
        if rep.get("nonfinite_steps_skipped"):
            info["nonfinite_steps_skipped"] = rep["nonfinite_steps_skipped"]
        if rep.get("failure"):
            f = rep["failure"]
            info["failure"] = {k: (str(v)[-2500:]) for k, v in f.items()} \
                if isinstance(f, dict) else str(f)[-2500:]
        info["marks"] = [json.load(open(p)) for p in sorted(glob.glob(f"{marks}/*.json"))]
        devs = {m["device"].split(":")[0] for m in info["marks"]}
        logs = ""
        for lp in sorted(glob.glob(os.path.join(out_dir, "logs", "*.log"))):
            logs += open(lp, errors="replace").read()
        if not logs:
            logs = out
        ok = rc == 0 and rep.get("status") == "succeeded" and devs == {self.device}
        if check_backend:
            formed = [ln.strip()[-160:] for ln in logs.splitlines() if "forming plan" in ln]
            info["plans"] = formed[:4]
            ok = ok and bool(formed) and all(ln.endswith(check_backend) for ln in formed)
        if expect_dtype:
            dts = {m["dtype"] for m in info["marks"]}
            info["dtype_ok"] = dts == {expect_dtype}
            ok = ok and info["dtype_ok"]
        if not expect_ok:  # a refusal is the right answer (fp16 without CUDA)
            ok = rc != 0 and "--amp=fp16 needs CUDA" in out
            info["refusal"] = [ln for ln in out.splitlines() if "needs CUDA" in ln][-2:]
        if not ok or not expect_ok:
            info["tail"] = out[-4000:]
            errs = [ln for ln in logs.splitlines() if "Error" in ln or "Traceback" in ln]
            info["error_lines"] = errs[:12]
        self.record(name, ok, **info)
        return info

    def bench(self, timeout: float) -> None:
        rounds, steps = ("1", "5") if self.quick else ("5", "40")
        cmd = [PY, os.path.join(ROOT, "benchmarks", "local_overhead.py"), "--device",
               self.device, "--rounds", rounds, "--steps", steps]
        rc, out, dt = self.sh(cmd, timeout)
        with open(os.path.join(self.out, "bench.txt"), "w") as f:
            f.write(" ".join(cmd) + "\n" + out)
        med = [ln for ln in out.splitlines() if ln.startswith("median:")]
        rounds_l = [ln for ln in out.splitlines() if ln.startswith("round ")]
        self.record("bench_local_overhead", rc == 0 and bool(med), rc=rc, seconds=round(dt, 1),
                    median=med[-1] if med else None, rounds=rounds_l,
                    tail="" if med else out[-3000:])

    def collect(self) -> None:
        with tarfile.open(os.path.join(self.out, "job_logs.tar.gz"), "w:gz") as t:
            for d in sorted(glob.glob(os.path.join(self.jobs_dir, "*"))):
                for sub in ("logs", "job_report.json", "replicas.json"):
                    p = os.path.join(d, sub)
                    if os.path.exists(p):
                        t.add(p, arcname=os.path.join(os.path.basename(d), sub))

    # ---------------------------------------------------------------- plan
    def run(self) -> None:
        self.env()
        dev = f"--device={self.device}"
        ep = "2" if self.quick else None
        steps = [
            ("pytest_cuda_units", lambda: self.pytest("pytest_cuda_units", [
                "tests/unit/ps/test_ps_trainer_schedule.py",
                "tests/unit/worker/test_local_optim.py", "-k", "cuda"], 150, self.cuda)),
            ("ps_1ps_2w_demo", lambda: self.job("ps_1ps_2w_demo", [
                "--cluster=local", "--distribution_strategy=ParameterServerStrategy",
                "--num_workers=2", "--num_ps_pods=1", "--grads_to_wait=2",
                f"--num_epochs={ep or 12}", "--evaluation_steps=40", dev], 150)),
            ("allreduce_1w_nccl", lambda: self.job("allreduce_1w_nccl", [
                "--cluster=local", "--distribution_strategy=AllreduceStrategy",
                "--num_workers=1", f"--num_epochs={ep or 4}", dev], 120,
                check_backend="nccl" if self.cuda else "gloo")),
            ("allreduce_1w_fp16", lambda: self.job("allreduce_1w_fp16", [
                "--cluster=local", "--distribution_strategy=AllreduceStrategy",
                "--num_workers=1", f"--num_epochs={ep or 3}", dev,
                "--amp=fp16" if self.cuda else "--amp=bf16"], 120,
                check_backend="nccl" if self.cuda else "gloo",
                expect_dtype="torch.float16" if self.cuda else "torch.bfloat16")),
            # two ranks cannot share one GPU under NCCL; gloo carries CUDA tensors
            ("allreduce_2w_gloo", lambda: self.job("allreduce_2w_gloo", [
                "--cluster=local", "--distribution_strategy=AllreduceStrategy",
                "--num_workers=2", f"--num_epochs={ep or 3}", dev, "--comm_backend=gloo"],
                120, check_backend="gloo")),
            ("local_amp_off", lambda: self.job("local_amp_off", [
                "--distribution_strategy=Local", f"--num_epochs={ep or 6}", "--amp=off", dev],
                90, expect_dtype="torch.float32")),
            ("local_amp_fp16", lambda: self.job("local_amp_fp16", [
                "--distribution_strategy=Local", f"--num_epochs={ep or 6}", "--amp=fp16", dev],
                90, expect_ok=self.cuda, expect_dtype="torch.float16")),
            ("local_amp_bf16", lambda: self.job("local_amp_bf16", [
                "--distribution_strategy=Local", f"--num_epochs={ep or 6}", "--amp=bf16", dev],
                90, expect_dtype="torch.bfloat16")),
            ("bench_local_overhead", lambda: self.bench(150)),
            ("ps_2ps_2w_fp16", lambda: self.job("ps_2ps_2w_fp16", [
                "--cluster=local", "--distribution_strategy=ParameterServerStrategy",
                "--num_workers=2", "--num_ps_pods=2", "--grads_to_wait=2",
                f"--num_epochs={ep or 4}", "--amp=fp16" if self.cuda else "--amp=bf16", dev],
                120, expect_dtype="torch.float16" if self.cuda else "torch.bfloat16")),
            ("pytest_gpu_marked", lambda: self.pytest("pytest_gpu_marked", [
                "tests/integration", "-m", "gpu"], 60, False)),
            ("pytest_cuda_aware_units", lambda: self.pytest("pytest_cuda_aware_units", [
                "tests/unit/elastic/test_elastic_group.py",
                "tests/unit/client/test_model_check.py"], 120, False)),
        ]
        for name, fn in steps:
            if self.only and name not in self.only:
                continue
            if self.left() < 20:
                self.record(name, None, reason=f"deadline: {self.left():.0f}s left")
                continue
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                import traceback

                self.record(name, False, error=f"{type(e).__name__}: {e}",
                            tail=traceback.format_exc()[-3000:])
        try:
            self.collect()
        except Exception as e:  # noqa: BLE001
            print(f"collect failed: {e}")
        st = self.results["steps"]
        self.results["totals"] = {s: sum(1 for v in st.values() if v["status"] == s)
                                  for s in ("PASS", "FAIL", "SKIP")}
        self.save()
        print("=== totals", self.results["totals"], f"elapsed {self.results['elapsed_s']}s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    ap.add_argument("--deadline", type=float, default=370.0,
                    help="seconds; later steps are skipped (SKIP) past it")
    ap.add_argument("--quick", action="store_true", help="2 epochs, 1 bench round (dry run)")
    ap.add_argument("--only", default="", help="comma-separated step names to run")
    ap.add_argument("--smoke", action="store_true",
                    help="the test suite's run: --quick, one Local job, output in a temp dir")
    a = ap.parse_args()
    if a.smoke:
        a.quick, a.only = True, "local_amp_off"
        a.out = tempfile.mkdtemp(prefix="gpu_check_smoke_")
    if not os.path.isdir(os.path.join(ROOT, "data", "digits", "train")):  # a fresh clone
        subprocess.run([PY, os.path.join(ROOT, "model_zoo", "digits", "prepare_data.py"),
                        f"--output={os.path.join(ROOT, 'data', 'digits')}"], check=True,
                       stdout=subprocess.DEVNULL)
    os.makedirs(a.out, exist_ok=True)
    checker = Checker(a.out, a.deadline, a.quick, a.only)
    if a.smoke:   # beside 3 other smoke runs on 2 cores a 2-epoch job took 99 s (> its 90)
        checker.slack = 3.0
    checker.run()
    shutil.rmtree(checker.work, ignore_errors=True)   # the jobs' logs are in --out's tarball
    if a.smoke:
        shutil.rmtree(a.out, ignore_errors=True)
    sys.exit(1 if checker.results.get("totals", {}).get("FAIL") else 0)


if __name__ == "__main__":
    main()
