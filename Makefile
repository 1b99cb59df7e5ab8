# Specula developer entry points.  `make demo` and `make test` each work on a
# fresh machine: they create .venv and install what is missing first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specula-installed
PYTEST_ARGS ?=
# Reference implementations the speculator tests compare against. Installed without
# their dependency pins (torch<=2.14, transformers<=5.19), which would downgrade the
# runtime's; their other dependencies are in the dev extra.
REFERENCE_PACKAGES := speculators==0.9.0 hs-connectors==0.9.0

# pytest with the control-plane binaries and helm built or reused first; their absence fails the run.
define with_control_plane
@bin_dir="$$(bash hack/control-plane.sh)" || { echo "make: control plane unavailable" >&2; exit 1; }; \
helm_dir="$$(bash hack/helm.sh)" || { echo "make: helm unavailable" >&2; exit 1; }; \
SPECULA_CONTROL_PLANE_BIN="$$bin_dir" SPECULA_HELM_BIN="$$helm_dir" $(BIN)/python -m pytest $(PYTEST_ARGS) $(1)
endef

.PHONY: setup demo test test-e2e test-gpu gpu-wheels test-unit test-runtime test-integration lint crd crd-check control-plane helm clean

$(STAMP): pyproject.toml hack/install.sh
	PYTHON=$(PYTHON) bash hack/install.sh $(VENV) -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(REFERENCE_PACKAGES)
	@touch $(STAMP)

## setup: create .venv with every dependency and build (or reuse) the test control plane and helm
setup: $(STAMP) control-plane helm

## control-plane: build etcd, kube-apiserver, kube-controller-manager, kubectl (cached by version)
control-plane:
	@bash hack/control-plane.sh >/dev/null

## helm: build the Helm CLI the chart tests use (cached by version)
helm:
	@bash hack/helm.sh >/dev/null

## demo: train the demo models on first run, serve them with speculation, report acceptance
demo: $(STAMP)
	$(BIN)/specula demo

## test: every tier (unit, runtime, integration, and end-to-end on a real node where the
## machine allows it: Linux and root); a missing control plane is a failure
test: $(STAMP)
	@$(BIN)/python -m specula.devcluster prepare --background
	$(call with_control_plane,-m "not gpu" tests)

## test-e2e: the end-to-end tier alone (a real node; builds its images first)
test-e2e: $(STAMP)
	$(call with_control_plane,tests/e2e)

## test-gpu: the CUDA tests (kernels, runners, every method through the engine in CUDA graphs); run on a GPU machine
test-gpu: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m gpu tests

## gpu-wheels: the wheels test-gpu needs on a CUDA machine without network access (hack/gpu-wheels.sh)
gpu-wheels: $(STAMP)
	PYTHON=$(BIN)/python bash hack/gpu-wheels.sh .wheels

test-unit: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS) tests/unit

test-runtime: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS) tests/runtime

test-integration: $(STAMP)
	$(call with_control_plane,tests/integration)

## lint: ruff, the import-layer contracts, and the checked-in CRD
lint: $(STAMP) crd-check
	$(BIN)/ruff check specula tests
	$(BIN)/lint-imports

## crd: regenerate crds/speculativemodel.yaml from specula.api, and the chart's CRD template from it
crd: $(STAMP)
	$(BIN)/specula crd > crds/speculativemodel.yaml
	$(BIN)/python hack/chart_crd.py

crd-check: $(STAMP)
	@$(BIN)/specula crd | diff -u crds/speculativemodel.yaml - \
	  || { echo "crds/speculativemodel.yaml is stale: run 'make crd'" >&2; exit 1; }
	@$(BIN)/python hack/chart_crd.py --check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
