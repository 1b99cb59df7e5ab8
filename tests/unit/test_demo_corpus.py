"""Demo corpus selection, recipe hash and cache location: deterministic and keyed correctly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from specula.demo.corpus import CorpusSpec, candidate_files, select_corpus, stdlib_root
from specula.demo.recipe import ModelShape, Recipe, cache_root, recipe_hash


def _write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text, encoding="utf-8")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    _write(tmp_path, "a.py", "def a():\n    return 1\n")
    _write(tmp_path, "pkg/__init__.py", "from .b import b\n")
    _write(tmp_path, "pkg/b.py", "def b():\n    return 2\n" * 3)
    _write(tmp_path, "pkg/test/test_b.py", "assert True\n")
    _write(tmp_path, "tests/test_a.py", "assert True\n")
    _write(tmp_path, "site-packages/x/y.py", "x = 1\n")
    _write(tmp_path, "encodings/cp1.py", "table = 1\n")
    _write(tmp_path, "_sysconfigdata__linux.py", "build = {}\n")
    _write(tmp_path, "notes.txt", "not python\n")
    _write(tmp_path, "empty.py", "   \n")
    return tmp_path


def test_candidates_exclude_tests_third_party_and_generated(tree: Path) -> None:
    assert candidate_files(tree) == ["a.py", "empty.py", "pkg/__init__.py", "pkg/b.py"]


def test_selection_is_deterministic_and_skips_empty_files(tree: Path) -> None:
    first = select_corpus(CorpusSpec(), tree)
    second = select_corpus(CorpusSpec(), tree)
    assert first == second
    assert sorted(first.paths) == ["a.py", "pkg/__init__.py", "pkg/b.py"]
    assert first.texts[first.paths.index("a.py")] == "def a():\n    return 1\n"


def test_byte_caps_bound_the_selection(tree: Path) -> None:
    full = select_corpus(CorpusSpec(), tree)
    capped = select_corpus(CorpusSpec(max_bytes=full.num_bytes - 1), tree)
    assert capped.num_bytes < full.num_bytes
    assert capped.paths == full.paths[: len(capped.paths)]
    small_files = select_corpus(CorpusSpec(max_file_bytes=30), tree)
    assert "pkg/b.py" not in small_files.paths


def test_digest_follows_content(tree: Path) -> None:
    before = select_corpus(CorpusSpec(), tree).digest
    _write(tree, "a.py", "def a():\n    return 3\n")
    assert select_corpus(CorpusSpec(), tree).digest != before


def test_split_holds_out_the_tail(tree: Path) -> None:
    corpus = select_corpus(CorpusSpec(), tree)
    train, val = corpus.split(0.02)
    assert len(val) == 1 and train + val == list(corpus.texts)


def test_empty_or_missing_root_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no eligible"):
        select_corpus(CorpusSpec(), tmp_path)
    with pytest.raises(FileNotFoundError):
        select_corpus(CorpusSpec(), tmp_path / "missing")


def test_stdlib_corpus_is_real_python_and_capped() -> None:
    spec = CorpusSpec(max_bytes=300_000)
    corpus = select_corpus(spec)
    assert corpus.root == stdlib_root()
    assert 0 < corpus.num_bytes <= spec.max_bytes
    assert not any("/test/" in f"/{p}" or p.startswith("site-packages") for p in corpus.paths)
    assert any("def " in t for t in corpus.texts)


def test_recipe_hash_covers_every_field_and_the_corpus() -> None:
    base = Recipe()
    h = recipe_hash(base, "c0")
    assert h == recipe_hash(Recipe(), "c0") and len(h) == 16
    assert recipe_hash(base, "c1") != h
    assert recipe_hash(dataclasses.replace(base, target_steps=base.target_steps + 1), "c0") != h
    assert recipe_hash(dataclasses.replace(base, draft=ModelShape(1, 128, 256, 2, 2)), "c0") != h
    bigger = dataclasses.replace(base.corpus, max_bytes=base.corpus.max_bytes + 1)
    assert recipe_hash(dataclasses.replace(base, corpus=bigger), "c0") != h


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("SPECULA_CACHE_DIR")
    assert cache_root() == tmp_path / "xdg" / "specula"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "specula"
