"""Container images for a local node, with no registry: bases built from Debian's
archive, the project's Dockerfile built with buildah (daemonless), and the results
imported into the node's containerd.

* :data:`BASE_IMAGE` — ``debootstrap --variant=minbase`` of Debian 12 with python3 and
  python3-venv, plus this machine's CA bundle and pip settings (so that builds behind a
  TLS-inspecting proxy reach PyPI as the host does).  It is both the operator's
  ``PYTHON_IMAGE`` and the CPU runtime's ``RUNTIME_BASE_IMAGE``.
* :data:`PAUSE_IMAGE` — the pod sandbox image: ``hack/pause`` built static with Go.
* :data:`OPERATOR_IMAGE`, :data:`RUNTIME_CPU_IMAGE` — the Dockerfile's ``operator`` and
  ``runtime`` targets on that base.

buildah keeps its storage under the cache directory with ``--layers``, so an unchanged
rebuild takes seconds; an image is exported (``docker-archive``) and imported with
``ctr images import`` only when containerd lacks that exact image ID.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specula import __version__

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = "specula.local/debian:bookworm"
PAUSE_IMAGE = "specula.local/pause:3.10"
OPERATOR_IMAGE = f"ghcr.io/specula-dev/specula-operator:{__version__}"
RUNTIME_CPU_IMAGE = f"ghcr.io/specula-dev/specula-runtime:{__version__}-cpu"
DEBIAN_SUITE = "bookworm"
BASE_PACKAGES = ("ca-certificates", "python3", "python3-venv")
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
PIP_ENV = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT")


def cache_root() -> Path:
    """``SPECULA_CACHE_DIR``, else ``$XDG_CACHE_HOME/specula`` (``~/.cache/specula``)."""
    root = os.environ.get("SPECULA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specula"
    )
    return Path(root)


class ImageError(RuntimeError):
    """An image could not be built, exported or imported; the message has the tail
    of the tool's output."""


def debian_mirror() -> str:
    """``SPECULA_DEBIAN_MIRROR``, else the first ``deb.debian.org``-style URI of this
    machine's apt sources, else ``http://deb.debian.org/debian``."""
    if os.environ.get("SPECULA_DEBIAN_MIRROR"):
        return os.environ["SPECULA_DEBIAN_MIRROR"]
    sources = [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]
    for source in sources:
        try:
            text = source.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split()
            uri = None
            if words[:1] == ["deb"]:
                uri = next((w for w in words[1:] if "://" in w), None)
            elif words[:1] == ["URIs:"] and len(words) > 1:
                uri = words[1]
            if uri and "security" not in uri and uri.rstrip("/").endswith("/debian"):
                return uri
    return "http://deb.debian.org/debian"


def _pip_conf() -> str:
    lines = ["[global]", "cert = /etc/ssl/certs/ca-certificates.crt"]
    for var in PIP_ENV:
        if os.environ.get(var):
            lines.append(f"{var[4:].lower().replace('_', '-')} = {os.environ[var]}")
    return "\n".join(lines) + "\n"


@dataclass
class ImageBuilder:
    """buildah with its own storage under ``cache_dir``; ``log`` receives progress lines."""

    cache_dir: Path = field(default_factory=lambda: cache_root() / "images")
    log: Callable[[str], None] = print
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def _global(self) -> list[str]:
        return [
            "buildah",
            "--root", str(self.cache_dir / "buildah" / "storage"),
            "--runroot", str(self.cache_dir / "buildah" / "run"),
            "--storage-driver", "overlay",
        ]

    def buildah(self, *args: str, timeout: float = 3600) -> str:
        """Run buildah; return stdout.

        Raises:
            ImageError: it exited non-zero.
        """
        proc = subprocess.run(
            [*self._global, *args], capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            raise ImageError(f"buildah {' '.join(args[:2])} exited {proc.returncode}:\n{tail}")
        return proc.stdout

    def image_id(self, name: str) -> str | None:
        """The image ID of ``name`` in buildah's storage, or None."""
        proc = subprocess.run(
            [*self._global, "inspect", "--type", "image", "--format", "{{.FromImageID}}", name],
            capture_output=True, text=True,
        )
        return proc.stdout.strip() or None if proc.returncode == 0 else None

    # -- bases -----------------------------------------------------------------------

    def _base_fingerprint(self) -> str:
        digest = hashlib.sha256()
        digest.update(f"{DEBIAN_SUITE} {BASE_PACKAGES} {debian_mirror()}".encode())
        if HOST_CA_BUNDLE.exists():
            digest.update(HOST_CA_BUNDLE.read_bytes())
        digest.update(_pip_conf().encode())
        return digest.hexdigest()[:16]

    def ensure_base(self) -> str:
        """Build :data:`BASE_IMAGE` unless built already from the same inputs; return
        its image ID.

        Raises:
            ImageError: debootstrap or buildah failed.
        """
        stamp = self.cache_dir / "buildah" / "base.fingerprint"
        fingerprint = self._base_fingerprint()
        existing = self.image_id(BASE_IMAGE)
        if existing and stamp.exists() and stamp.read_text() == fingerprint:
            return existing
        t0 = time.monotonic()
        self.log(f"images: debootstrap {DEBIAN_SUITE} from {debian_mirror()} (about a minute)")
        container = self.buildah("from", "scratch").strip()
        try:
            root = Path(self.buildah("mount", container).strip())
            proc = subprocess.run(
                [
                    "debootstrap", "--variant=minbase",
                    f"--include={','.join(BASE_PACKAGES)}",
                    DEBIAN_SUITE, str(root), debian_mirror(),
                ],
                capture_output=True, text=True, timeout=1800,
            )
            if proc.returncode != 0:
                tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
                raise ImageError(f"debootstrap exited {proc.returncode}:\n{tail}")
            # Trust what this machine trusts (a TLS-inspecting proxy's CA included),
            # also after the image's own update-ca-certificates runs.
            if HOST_CA_BUNDLE.exists():
                local = root / "usr/local/share/ca-certificates"
                local.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(HOST_CA_BUNDLE, local / "host-bundle.crt")
                shutil.copyfile(HOST_CA_BUNDLE, root / "etc/ssl/certs/ca-certificates.crt")
            (root / "etc/pip.conf").write_text(_pip_conf())
            shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
            (root / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
            self.buildah("umount", container)
            self.buildah("config", "--cmd", "/bin/bash", container)
            self.buildah("commit", "--quiet", "--rm", container, BASE_IMAGE)
        except BaseException:
            subprocess.run([*self._global, "rm", container], capture_output=True)
            raise
        stamp.write_text(fingerprint)
        self.timings["base_image_s"] = time.monotonic() - t0
        return self.image_id(BASE_IMAGE) or ""

    def ensure_pause(self) -> str:
        """Build :data:`PAUSE_IMAGE` from ``hack/pause`` (Go, static) unless present.

        Raises:
            ImageError: go or buildah failed.
        """
        existing = self.image_id(PAUSE_IMAGE)
        if existing:
            return existing
        self.log("images: building the pause image (hack/pause, Go)")
        with tempfile.TemporaryDirectory() as tmp:
            binary = Path(tmp) / "pause"
            proc = subprocess.run(
                ["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", str(binary), "."],
                cwd=REPO_ROOT / "hack" / "pause",
                env={**os.environ, "CGO_ENABLED": "0"},
                capture_output=True, text=True, timeout=600,
            )
            if proc.returncode != 0:
                raise ImageError(f"go build hack/pause exited {proc.returncode}:\n{proc.stderr}")
            container = self.buildah("from", "scratch").strip()
            try:
                self.buildah("copy", container, str(binary), "/pause")
                self.buildah("config", "--entrypoint", '["/pause"]', "--user", "65535:65535",
                             container)
                self.buildah("commit", "--quiet", "--rm", container, PAUSE_IMAGE)
            except BaseException:
                subprocess.run([*self._global, "rm", container], capture_output=True)
                raise
        return self.image_id(PAUSE_IMAGE) or ""

    # -- the Dockerfile ---------------------------------------------------------------

    def build_target(self, target: str, tag: str, build_args: dict[str, str]) -> str:
        """``buildah bud --target TARGET`` of the repository's Dockerfile; return the
        image ID.  Steps run with chroot isolation and the host's network.

        Raises:
            ImageError: the build failed (the message ends with its output).
        """
        t0 = time.monotonic()
        args = ["bud", "--layers", "--isolation", "chroot", "--network", "host",
                "--target", target, "-t", tag, "-f", str(REPO_ROOT / "Dockerfile")]
        for key, value in build_args.items():
            args += ["--build-arg", f"{key}={value}"]
        self.buildah(*args, str(REPO_ROOT), timeout=3600)
        self.timings[f"build_{target}_s"] = time.monotonic() - t0
        self.prune()
        return self.image_id(tag) or ""

    def prune(self) -> None:
        """Remove images no tag reaches any more (earlier builds; a runtime image is
        gigabytes), keeping the layers the tagged images are built on."""
        subprocess.run([*self._global, "rm", "--all"], capture_output=True)
        for _ in range(3):
            proc = subprocess.run([*self._global, "rmi", "--prune"], capture_output=True,
                                  text=True)
            if proc.returncode != 0 or not proc.stdout.strip():
                break

    def build_operator(self) -> str:
        """The ``operator`` target on :data:`BASE_IMAGE`, tagged :data:`OPERATOR_IMAGE`."""
        self.ensure_base()
        self.log(f"images: building {OPERATOR_IMAGE} (Dockerfile target operator)")
        return self.build_target("operator", OPERATOR_IMAGE, {"PYTHON_IMAGE": BASE_IMAGE})

    def build_runtime_cpu(self) -> str:
        """The ``runtime`` target on :data:`BASE_IMAGE` (the CPU variant), tagged
        :data:`RUNTIME_CPU_IMAGE`.  A cold build downloads PyTorch (minutes)."""
        self.ensure_base()
        self.log(f"images: building {RUNTIME_CPU_IMAGE} (Dockerfile target runtime, CPU base)")
        return self.build_target("runtime", RUNTIME_CPU_IMAGE, {"RUNTIME_BASE_IMAGE": BASE_IMAGE})

    # -- into containerd --------------------------------------------------------------

    def import_into(self, name: str, ctr: list[str], stamp_dir: Path) -> bool:
        """Import ``name`` into containerd (``ctr`` is the ctr command with its address
        and the ``k8s.io`` namespace) unless it holds that image ID already; returns
        whether it imported.

        Raises:
            ImageError: the export or the import failed.
        """
        image_id = self.image_id(name)
        if image_id is None:
            raise ImageError(f"{name} is not built")
        stamp = stamp_dir / (name.replace("/", "_").replace(":", "_") + ".id")
        listed = subprocess.run([*ctr, "images", "ls", "-q"], capture_output=True, text=True)
        present = name in listed.stdout.split()
        if present and stamp.exists() and stamp.read_text() == image_id:
            return False
        t0 = time.monotonic()
        self.log(f"images: importing {name} into containerd")
        stamp_dir.mkdir(parents=True, exist_ok=True)
        if present:
            # Free the earlier build's content before the new one lands.
            subprocess.run([*ctr, "images", "rm", "--sync", name], capture_output=True)
        with tempfile.TemporaryDirectory(dir=self.cache_dir) as tmp:
            archive = Path(tmp) / "image.tar"
            self.buildah("push", "--quiet", name, f"docker-archive:{archive}:{name}")
            proc = subprocess.run(
                [*ctr, "images", "import", str(archive)],
                capture_output=True, text=True, timeout=3600,
            )
            if proc.returncode != 0:
                raise ImageError(f"ctr images import {name} exited {proc.returncode}:\n"
                                 f"{proc.stderr}{proc.stdout}")
        stamp.write_text(image_id)
        self.timings[f"import_{name.rsplit('/', 1)[-1]}_s"] = time.monotonic() - t0
        return True
