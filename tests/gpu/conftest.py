"""Fixtures of the GPU tests: the demo's trained Llama target and EAGLE-3 head (``make
demo``; the directory comes from ``SPECULA_DEMO_DIR`` or the demo cache), its tokenizer
and the demo prompts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def demo_models() -> tuple[Path, Path] | None:
    env = os.environ.get("SPECULA_DEMO_DIR")
    if env:
        roots = [Path(env)]
    else:
        from specula.demo.recipe import cache_root

        roots = [p.parent for p in (cache_root() / "demo").glob("*/COMPLETE.json")]
    for root in roots:
        heads = sorted(root.glob("heads-*/eagle3/config.json"))
        if (root / "target" / "config.json").is_file() and heads:
            return root / "target", heads[-1].parent
    return None


@pytest.fixture(scope="session")
def demo():
    found = demo_models()
    if found is None:
        pytest.skip("no demo models: run `make demo` or set SPECULA_DEMO_DIR")
    return found


@pytest.fixture(scope="session")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo[0]))


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    from specula.demo.prompts import PROMPTS

    return [tokenizer(p)["input_ids"] for p in PROMPTS]
