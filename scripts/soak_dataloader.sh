#!/usr/bin/env bash
# Issue 32's soak: N consecutive runs of the DataLoader tests and of a CLI job whose workers
# load a module's dataset through a DataLoader with 2 loader processes (gRPC, prefetch and
# push threads running in the worker), each bounded in time, while `make demo` runs beside
# them in a loop (a loaded machine). Any hang, failure or inexact count stops the soak.
#   scripts/soak_dataloader.sh [N] [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-20}
OUT=${2:-out/soak-dataloader}
PY=.venv/bin/python
rm -rf "$OUT" && mkdir -p "$OUT"
$PY -c "import numpy as np; np.save('$OUT/ids.npy', np.arange(512, dtype=np.int64))"
( while true; do make demo >>"$OUT/demo.log" 2>&1; done ) &
DEMO=$!
trap 'kill $DEMO 2>/dev/null; pkill -f "job_name=digits-demo" 2>/dev/null; wait' EXIT
fail=0
for i in $(seq 1 "$N"); do
  start=$(date +%s)
  timeout -k 10 300 $PY -m pytest tests/unit/data/test_prefetch_and_datasets.py -q \
      -p no:cacheprovider >"$OUT/tests-$i.log" 2>&1 || { echo "run $i: DataLoader tests failed (rc $?)"; fail=1; break; }
  job="$OUT/job-$i"
  COUNT_RECORDS=512 timeout -k 10 400 .venv/bin/elasticdl train \
      --model_zoo=tests/fixtures/zoo --model_def=toy.count_dataset.custom_model \
      --training_data="$OUT/ids.npy" --output="$job" --job_name="soak-$i" --cluster=local \
      --distribution_strategy=ParameterServerStrategy --num_workers=2 --num_ps_pods=1 \
      --num_epochs=2 --minibatch_size=8 --num_minibatches_per_task=4 \
      --data_loader_workers=2 >"$OUT/job-$i.log" 2>&1 || { echo "run $i: job failed (rc $?)"; fail=1; break; }
  $PY - "$job" <<'PYEOF' || { echo "run $i: counts wrong"; fail=1; break; }
import json, sys, torch
job = sys.argv[1]
r = json.load(open(f"{job}/job_report.json"))
assert r["status"] == "succeeded", r["failure"]
assert [e["records_completed"] for e in r["epochs"]] == [512, 512], r["epochs"]
s = torch.load(f"{job}/model.pt", weights_only=True)
assert all(s[n].tolist() == [2.0] * 512 for n in ("even", "odd"))
PYEOF
  echo "run $i: ok in $(( $(date +%s) - start )) s ($(tail -1 "$OUT/tests-$i.log"))"
done
[ $fail = 0 ] && echo "soak: $N of $N runs passed"
exit $fail
