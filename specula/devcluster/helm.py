"""The Helm CLI: located (built once by ``hack/helm.sh``) and run with its own config
and cache directories.

``SPECULA_HELM_BIN`` (the directory holding ``helm``, as ``make test`` sets it) wins;
otherwise ``hack/helm.sh`` builds Helm from the Go module proxy or reuses its cache.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from specula.devcluster.control_plane import REPO_ROOT

CHART = REPO_ROOT / "charts" / "specula"
RELEASE = "specula"
RELEASE_NAMESPACE = "specula-system"


class HelmError(RuntimeError):
    """Helm could not be built or found."""


_located: dict[str, Path | str] = {}


def find_helm() -> Path:
    """Path of the ``helm`` binary (cached per process).

    Raises:
        HelmError: ``SPECULA_HELM_BIN`` lacks an executable ``helm``, or
            ``hack/helm.sh`` failed.
    """
    if "error" in _located:
        raise HelmError(str(_located["error"]))
    if "helm" not in _located:
        try:
            _located["helm"] = _locate()
        except HelmError as exc:
            _located["error"] = str(exc)
            raise
    return Path(_located["helm"])


def _locate() -> Path:
    env_dir = os.environ.get("SPECULA_HELM_BIN")
    if env_dir:
        bin_dir, source = Path(env_dir), "SPECULA_HELM_BIN"
    else:
        script = REPO_ROOT / "hack" / "helm.sh"
        proc = subprocess.run(
            ["bash", str(script)], capture_output=True, text=True, cwd=REPO_ROOT
        )
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.splitlines()[-40:])
            raise HelmError(f"{script} exited {proc.returncode}:\n{tail}")
        lines = proc.stdout.strip().splitlines()
        if not lines:
            raise HelmError(f"{script} printed no binary directory")
        bin_dir, source = Path(lines[-1]), str(script)
    helm = bin_dir / "helm"
    if not os.access(helm, os.X_OK):
        raise HelmError(f"{source}: {bin_dir} has no executable helm")
    return helm


@dataclass
class Helm:
    """One Helm binary with private config/cache/data directories under ``home``
    (so tests neither read nor write the user's Helm repositories)."""

    binary: Path
    home: Path

    def run(
        self,
        *args: str,
        kubeconfig: Path | None = None,
        check: bool = True,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess:
        """``helm ARGS``; text output.  With ``check``, a non-zero exit raises
        AssertionError carrying Helm's output."""
        env = {
            **os.environ,
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_DATA_HOME": str(self.home / "data"),
        }
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        proc = subprocess.run(
            [str(self.binary), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            cwd=REPO_ROOT,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}{proc.stdout}"
            )
        return proc

    def template(
        self,
        *values_files: Path,
        sets: tuple[str, ...] = (),
        release: str = RELEASE,
        namespace: str = RELEASE_NAMESPACE,
    ) -> list[dict[str, Any]]:
        """The chart rendered with ``values_files`` and ``--set`` ``sets``, as objects."""
        args = ["template", release, str(CHART), "--namespace", namespace]
        for path in values_files:
            args += ["--values", str(path)]
        for item in sets:
            args += ["--set", item]
        return parse_manifests(self.run(*args).stdout)


def parse_manifests(text: str) -> list[dict[str, Any]]:
    """Objects of a multi-document YAML stream, empty documents dropped."""
    return [doc for doc in yaml.safe_load_all(text) if doc]
