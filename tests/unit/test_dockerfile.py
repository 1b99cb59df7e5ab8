"""The Dockerfile: its stages, pinned bases, non-root users, entry points, and an
install step shared with ``make setup``.  Docker itself does not run here, so the file
is parsed (instructions, line continuations, ``ARG`` substitution in ``FROM``)."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from specula.api.render import METRICS_PORT, RUNTIME_PORT
from specula.cli import build_parser
from specula.operator.builders import CONFIG_PATH, RUN_AS_USER

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
INSTALL_SCRIPT = "hack/install.sh"
VENV = "/opt/specula"
RUNTIME_ONLY = {"torch", "transformers", "tokenizers", "safetensors", "fastapi", "uvicorn"}
"""Distributions only the runtime needs; none may reach the operator image."""


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def logical_lines(text: str) -> list[str]:
    """Instructions with continuations joined; comment and blank lines dropped (Docker
    also drops comment lines inside a continuation)."""
    out: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    assert not pending, "Dockerfile ends inside a line continuation"
    return out


def substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], text)


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ``ARG`` defaults and the stages, bases substituted."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            global_args[name] = default
        elif keyword == "FROM":
            words = rest.split()
            assert words[0].startswith("--") is False, f"FROM flags are not expected: {line}"
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=substitute(words[0], global_args), name=name))
        else:
            assert stages, f"{keyword} before the first FROM"
            stages[-1].instructions.append((keyword, rest))
    return global_args, stages


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    _, parsed = parse(DOCKERFILE.read_text())
    return {s.name: s for s in parsed if s.name}


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def lineage(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    chain = [stages[name]]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain


def effective(stages: dict[str, Stage], name: str, keyword: str) -> str | None:
    """The last ``keyword`` instruction that applies to stage ``name`` (inherited from
    its parent stages, as USER, ENTRYPOINT and CMD are)."""
    for stage in lineage(stages, name):
        found = stage.all(keyword)
        if found:
            return found[-1]
    return None


def install_runs(stage: Stage) -> list[list[str]]:
    """``hack/install.sh`` invocations of a stage's RUN instructions, as argv after the
    script name."""
    found = []
    for run in stage.all("RUN"):
        for command in re.split(r"&&|;", run):
            argv = shlex.split(command)
            if INSTALL_SCRIPT in argv:
                found.append(argv[argv.index(INSTALL_SCRIPT) + 1:])
    return found


def test_parser_sees_continuations_and_args():
    global_args, parsed = parse(
        "ARG BASE=python:3.12.8-slim\n# comment\nFROM ${BASE} AS a\nRUN one \\\n"
        "# inside\n && two\nFROM a\nUSER 10\n"
    )
    assert global_args == {"BASE": "python:3.12.8-slim"}
    assert [(s.base, s.name) for s in parsed] == [("python:3.12.8-slim", "a"), ("a", None)]
    assert parsed[0].all("RUN") == ["one  && two"]


def test_operator_and_runtime_targets_exist(stages):
    assert {"operator", "runtime"} <= set(stages)
    # Each final image comes from its own build stage: the runtime's CUDA stack never
    # reaches the operator image and vice versa.
    assert all(s.base != "runtime-base" for s in lineage(stages, "operator"))
    assert any(s.base.startswith("nvidia/cuda:") for s in lineage(stages, "runtime"))


def test_base_images_are_pinned_to_full_versions():
    _, parsed = parse(DOCKERFILE.read_text())
    names = {s.name for s in parsed if s.name}
    external = [s.base for s in parsed if s.base not in names]
    assert external, "no external base image"
    for image in external:
        repo, sep, tag = image.rpartition(":")
        assert sep and "/" not in tag, f"{image}: no tag"
        assert tag != "latest", f"{image}: floating tag"
        assert re.search(r"\d+\.\d+\.\d+", tag), f"{image}: tag is not a full x.y.z version"


def test_python_of_both_images_satisfies_requires_python(stages):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    minimum = tuple(int(x) for x in re.fullmatch(r">=(\d+)\.(\d+)", project["requires-python"]).groups())
    python_base = re.match(r"python:(\d+)\.(\d+)\.", lineage(stages, "operator")[-1].base)
    assert python_base and tuple(map(int, python_base.groups())) >= minimum
    # The runtime installs its distribution's python3: 3.12 on the CUDA image's Ubuntu
    # 24.04, 3.11 on the Debian 12 base of the CPU variant (specula.devcluster.images).
    from specula.devcluster.images import DEBIAN_SUITE

    distro_python = {"ubuntu24.04": (3, 12), "bookworm": (3, 11)}
    runtime_base = lineage(stages, "runtime")[-1].base
    distro = next(d for d in distro_python if runtime_base.endswith(d))
    assert distro_python[distro] >= minimum
    assert distro_python[DEBIAN_SUITE] >= minimum
    assert any("python3-venv" in run.split() for run in stages["runtime"].all("RUN"))


@pytest.mark.parametrize("target", ["operator", "runtime"])
def test_final_stages_run_as_the_numeric_non_root_uid_the_pods_use(stages, target):
    user = effective(stages, target, "USER")
    assert user is not None, f"{target} runs as root"
    uid, _, gid = user.partition(":")
    # Numeric: the kubelet checks runAsNonRoot against the image's USER and cannot
    # resolve names.
    assert uid.isdigit() and int(uid) != 0, user
    assert int(uid) == RUN_AS_USER and (not gid or int(gid) == RUN_AS_USER), user


def test_entry_points_are_specula_commands(stages):
    for target, cmd in (("operator", ["operator"]), ("runtime", ["serve", "--config", CONFIG_PATH])):
        assert exec_form(effective(stages, target, "ENTRYPOINT")) == ["specula"]
        assert exec_form(effective(stages, target, "CMD")) == cmd
        # The CLI accepts it (parsing only; nothing is started).
        assert build_parser().parse_args(cmd).command == cmd[0]


def test_runtime_exposes_the_ports_the_operator_wires(stages):
    exposed = {int(p) for e in stages["runtime"].all("EXPOSE") for p in e.split()}
    assert exposed == {RUNTIME_PORT, METRICS_PORT}


def test_install_step_is_the_one_make_setup_runs(stages):
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^\$\(STAMP\):.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe, "Makefile has no $(STAMP) rule"
    assert re.search(rf"bash {re.escape(INSTALL_SCRIPT)} \$\(VENV\) ", recipe.group(1)), (
        f"make setup no longer installs through {INSTALL_SCRIPT}"
    )
    for build in ("operator-build", "runtime"):
        assert any(
            shlex.split(c)[-2:] == [INSTALL_SCRIPT, INSTALL_SCRIPT]
            for c in stages[build].all("COPY")
        ), f"{build} does not copy {INSTALL_SCRIPT}"
    # The operator: one install in a build stage, the environment copied.
    runs = install_runs(stages["operator-build"])
    assert len(runs) == 1 and runs[0][0] == VENV, runs
    assert any(
        c.startswith("--from=operator-build ") and c.split()[1:] == [VENV, VENV]
        for c in stages["operator"].all("COPY")
    ), f"operator does not take {VENV} from operator-build"
    # The runtime: the dependencies, then (after the code is copied) the project alone.
    runs = install_runs(stages["runtime"])
    assert [r[:2] for r in runs] == [["--deps-only", VENV], [VENV, "--no-deps"]], runs
    assert runs[0][-1] == runs[1][-1], "the two steps install different extras"
    order = [kw + " " + args for kw, args in stages["runtime"].instructions]
    deps = next(i for i, line in enumerate(order) if "--deps-only" in line)
    code = next(i for i, line in enumerate(order) if line.startswith("COPY specula "))
    assert deps < code, "the dependency layer must not depend on the code"
    for final in ("operator", "runtime"):
        assert any(f"PATH={VENV}/bin:" in env for env in stages[final].all("ENV"))
    # No second install procedure next to the script.
    for stage in stages.values():
        for run in stage.all("RUN"):
            assert not re.search(r"\bpip3?\b.*\binstall\b", run), f"direct pip install: {run}"


def _install_target(stages, build: str) -> tuple[str, set[str]]:
    specs = {argv[-1] for argv in install_runs(stages[build])}
    assert len(specs) == 1, specs
    (spec,) = specs
    match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", spec)
    assert match, f"{build} installs {spec!r}, not the project in the context"
    return spec, set((match.group(1) or "").split(",")) - {""}


def _names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}


def test_operator_image_installs_no_torch(stages):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    _, extras = _install_target(stages, "operator-build")
    installed = _names(project["dependencies"])
    for extra in extras:
        installed |= _names(project["optional-dependencies"][extra])
    leaked = installed & RUNTIME_ONLY
    assert not leaked, (
        f"the operator image would install {sorted(leaked)}: pyproject.toml must keep "
        "runtime-only dependencies in the `runtime` extra"
    )


def test_runtime_image_installs_the_runtime_extra(stages):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    _, extras = _install_target(stages, "runtime")
    assert "runtime" in extras
    installed = _names(project["dependencies"])
    for extra in extras:
        assert extra in project.get("optional-dependencies", {}), f"no extra {extra!r}"
        installed |= _names(project["optional-dependencies"][extra])
    assert RUNTIME_ONLY <= installed


def _glob_regex(pattern: str) -> str:
    """A .dockerignore glob as a regex: ``*`` and ``?`` never cross ``/``; a leading
    ``**/`` matches any number of directories."""
    prefix = ""
    if pattern.startswith("**/"):
        prefix, pattern = "(?:.*/)?", pattern[3:]
    body = "".join(
        "[^/]*" if ch == "*" else "[^/]" if ch == "?" else re.escape(ch) for ch in pattern
    )
    return prefix + body


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent
    directories wins; ``!`` re-includes."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _glob_regex(pattern.removeprefix("!").strip("/"))
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_what_the_images_copy_and_drops_the_rest(stages):
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied: set[str] = set()
    for stage in stages.values():
        for copy in stage.all("COPY"):
            words = shlex.split(copy)
            if any(w.startswith("--from=") for w in words):
                continue
            copied.update(w.rstrip("/") for w in words[:-1] if not w.startswith("--"))
    assert {"pyproject.toml", "README.md", INSTALL_SCRIPT, "specula"} <= copied
    package_files = [
        str(p.relative_to(ROOT)) for p in (ROOT / "specula").rglob("*.py")
    ]
    for path in [*copied - {"specula"}, *package_files]:
        assert (ROOT / path).exists(), f"COPY source {path} missing"
        assert not dockerignore_excludes(patterns, path), f".dockerignore drops {path}"
    for path in [".venv/bin/python", "tests/unit/test_dockerfile.py", ".git/HEAD",
                 "specula/__pycache__/cli.cpython-311.pyc"]:
        assert dockerignore_excludes(patterns, path), f".dockerignore keeps {path}"


def test_runtime_image_has_what_triton_compiles_its_launchers_with(stages):
    """Triton builds each kernel's C launcher at first use with ``gcc`` (or ``$CC``)
    against the interpreter's ``Python.h``: the GPU engine's kernels fail without them."""
    packages: set[str] = set()
    for stage in lineage(stages, "runtime"):
        for run in stage.all("RUN"):
            if "apt-get install" in run:
                packages |= set(run.split("apt-get install", 1)[1].split("&&", 1)[0].split())
    assert {"gcc", "libc6-dev", "python3-dev"} <= packages
