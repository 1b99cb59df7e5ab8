"""Shared fixtures for the unit tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from specula.demo.corpus import CorpusSpec
from specula.demo.recipe import ModelShape, Recipe


@pytest.fixture
def demo_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``SPECULA_CACHE_DIR`` set to ``tmp_path``; returns ``cached_recipe(target_layers)``:
    a demo :class:`Recipe` that trains in seconds (40 kB of corpus, one step per model,
    16-wide models of ``target_layers`` target layers and one draft layer)."""
    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path))

    def cached_recipe(target_layers: int) -> Recipe:
        return Recipe(
            corpus=CorpusSpec(max_bytes=40_000), vocab_size=300, seq_len=16,
            max_position_embeddings=32, batch_size=2,
            target=ModelShape(target_layers, 16, 32, 2, 1), draft=ModelShape(1, 16, 32, 2, 1),
            target_steps=1, draft_steps=1, warmup_steps=1, eval_batches=1,
        )

    return cached_recipe
