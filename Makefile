# Specula developer entry points.  `make demo` and `make test` each work on a
# fresh machine: they create .venv and install what is missing first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specula-installed
PYTEST_ARGS ?=

# pytest with the control-plane binaries built or reused first; their absence fails the run.
define with_control_plane
@bin_dir="$$(bash hack/control-plane.sh)" || { echo "make: control plane unavailable" >&2; exit 1; }; \
SPECULA_CONTROL_PLANE_BIN="$$bin_dir" $(BIN)/python -m pytest $(PYTEST_ARGS) $(1)
endef

.PHONY: setup demo test test-unit test-runtime test-integration lint crd crd-check control-plane clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

## setup: create .venv with every dependency and build (or reuse) the test control plane
setup: $(STAMP) control-plane

## control-plane: build etcd, kube-apiserver, kube-controller-manager, kubectl (cached by version)
control-plane:
	@bash hack/control-plane.sh >/dev/null

## demo: train the demo models on first run, serve them with speculation, report acceptance
demo: $(STAMP)
	$(BIN)/specula demo

## test: every tier (unit, runtime, integration); a missing control plane is a failure
test: $(STAMP)
	$(call with_control_plane,-m "not gpu" tests)

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

## crd: regenerate crds/speculativemodel.yaml from specula.api
crd: $(STAMP)
	$(BIN)/specula crd > crds/speculativemodel.yaml

crd-check: $(STAMP)
	@$(BIN)/specula crd | diff -u crds/speculativemodel.yaml - \
	  || { echo "crds/speculativemodel.yaml is stale: run 'make crd'" >&2; exit 1; }

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
