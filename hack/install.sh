#!/usr/bin/env bash
# Install Specula into a virtual environment, creating the environment if absent:
# the one install procedure of `make setup` and of the Dockerfile's images.
#
# Usage: hack/install.sh VENV PIP_INSTALL_ARGS...
#   hack/install.sh .venv -e '.[dev]'          # make setup
#   hack/install.sh /opt/specula '.[runtime]'  # Dockerfile, runtime image
#
# Environment:
#   PYTHON  interpreter that creates the environment (default: python3)
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 VENV PIP_INSTALL_ARGS..." >&2
  exit 2
fi
venv="$1"
shift

[[ -x "$venv/bin/python" ]] || "${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "$@"
