#!/usr/bin/env bash
# Install Specula into a virtual environment, creating the environment if absent:
# the one install procedure of `make setup` and of the Dockerfile's images.
#
# Usage: hack/install.sh [--deps-only] VENV PIP_INSTALL_ARGS...
#   hack/install.sh .venv -e '.[dev]'                         # make setup
#   hack/install.sh --deps-only /opt/specula '.[runtime]'     # Dockerfile, runtime image:
#   hack/install.sh /opt/specula --no-deps '.[runtime]'       #   dependencies, then Specula
#
# --deps-only installs the requirements pyproject.toml lists for the project and the
# extras named in PIP_INSTALL_ARGS (`.[a,b]`), without the project itself, so that an
# image can keep them in a layer that a change of the code alone does not invalidate.
#
# Environment:
#   PYTHON  interpreter that creates the environment (default: python3)
set -euo pipefail

deps_only=0
if [[ "${1:-}" == "--deps-only" ]]; then
  deps_only=1
  shift
fi
if [[ $# -lt 2 ]]; then
  echo "usage: $0 [--deps-only] VENV PIP_INSTALL_ARGS..." >&2
  exit 2
fi
venv="$1"
shift

[[ -x "$venv/bin/python" ]] || "${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
if [[ $deps_only -eq 0 ]]; then
  "$venv/bin/python" -m pip install --quiet "$@"
  exit 0
fi
# The requirements of the project and of the extras in `.[extra,...]`, self-references
# such as "specula[runtime]" expanded.
mapfile -t requirements < <("$venv/bin/python" - "$@" <<'PY'
import re
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
name = project["name"]
extras = project.get("optional-dependencies", {})
out = list(project["dependencies"])
seen = set()


def add_extra(extra):
    if extra in seen:
        return
    seen.add(extra)
    for req in extras[extra]:
        self_ref = re.fullmatch(rf"{re.escape(name)}\[([\w,-]+)\]", req.replace(" ", ""))
        if self_ref:
            for inner in self_ref.group(1).split(","):
                add_extra(inner)
        else:
            out.append(req)


for arg in sys.argv[1:]:
    match = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
    if match:
        for extra in match.group(1).split(","):
            add_extra(extra)
print("\n".join(dict.fromkeys(out)))
PY
)
"$venv/bin/python" -m pip install --quiet "${requirements[@]}"
