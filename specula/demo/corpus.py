"""The demo corpus: Python source files of the standard library of the running interpreter.

Every machine that runs the demo has this corpus, so no download is needed. The selection is
deterministic for a given standard library: candidate files are ordered by the SHA-256 of their
relative path (which mixes packages instead of taking them alphabetically) and taken until a byte
cap is reached. The digest of the selected paths and contents enters the recipe hash, so a
different interpreter version trains (and caches) its own models.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

#: Directory names never read: test suites (code that is mostly assertions), third-party
#: packages, and generated or data-like modules (codec tables, the pydoc topic dump).
EXCLUDED_DIRS: frozenset[str] = frozenset(
    {
        "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
        "encodings", "pydoc_data", "turtledemo", "ensurepip",
    }
)
#: File name prefixes never read: build-time generated configuration dumps.
EXCLUDED_PREFIXES: tuple[str, ...] = ("_sysconfigdata",)


@dataclass(frozen=True)
class CorpusSpec:
    """What to read from the standard library."""

    max_bytes: int = 4_000_000
    """Cap on the UTF-8 size of the selected text, in bytes; selection stops at the first file
    that would cross it. ~4 MB is about 1M BPE tokens, more than the training budget consumes."""

    max_file_bytes: int = 256_000
    """Files larger than this (bytes) are skipped, so one huge module cannot dominate."""

    val_fraction: float = 0.02
    """Fraction of the selected files (by count, taken from the end of the order) held out
    for the validation loss."""


@dataclass(frozen=True)
class Corpus:
    """The selected documents, in selection order."""

    root: Path
    paths: tuple[str, ...]
    """POSIX paths relative to ``root``."""
    texts: tuple[str, ...]
    digest: str
    """SHA-256 (hex) over every selected path and its bytes; identifies the corpus."""

    @property
    def num_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in self.texts)

    def split(self, val_fraction: float) -> tuple[list[str], list[str]]:
        """Split into (train, validation) texts; validation is the last ``val_fraction`` of files
        (at least one file when there are two or more)."""
        n = len(self.texts)
        n_val = max(1, round(n * val_fraction)) if n >= 2 else 0
        return list(self.texts[: n - n_val]), list(self.texts[n - n_val :])


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def candidate_files(root: Path) -> list[str]:
    """Relative POSIX paths of every eligible ``.py`` file under ``root``, sorted.

    Excludes :data:`EXCLUDED_DIRS` at any depth and :data:`EXCLUDED_PREFIXES`; symlinks are
    not followed so the walk cannot escape ``root`` or loop.
    """
    out: list[str] = []
    # os.walk with in-place pruning: excluded trees (site-packages can be large) are never read.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        base = Path(dirpath)
        for name in filenames:
            path = base / name
            if not name.endswith(".py") or name.startswith(EXCLUDED_PREFIXES):
                continue
            if path.is_symlink() or not path.is_file():
                continue
            out.append(path.relative_to(root).as_posix())
    out.sort()
    return out


def _order_key(rel: str) -> str:
    return hashlib.sha256(rel.encode("utf-8")).hexdigest()


def select_corpus(spec: CorpusSpec, root: Path | None = None) -> Corpus:
    """Read the corpus described by ``spec`` from ``root`` (default: :func:`stdlib_root`).

    Files that are not valid UTF-8 or exceed ``spec.max_file_bytes`` are skipped.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: no eligible file was found under ``root``.
    """
    root = stdlib_root() if root is None else root
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    paths: list[str] = []
    texts: list[str] = []
    total = 0
    h = hashlib.sha256()
    for rel in sorted(candidate_files(root), key=_order_key):
        data = (root / rel).read_bytes()
        if len(data) > spec.max_file_bytes or not data.strip():
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if total + len(data) > spec.max_bytes:
            break
        total += len(data)
        paths.append(rel)
        texts.append(text)
        h.update(rel.encode("utf-8") + b"\0" + len(data).to_bytes(8, "little") + data)
    if not paths:
        raise ValueError(f"no eligible .py files under {root}")
    return Corpus(root=root, paths=tuple(paths), texts=tuple(texts), digest=h.hexdigest())
