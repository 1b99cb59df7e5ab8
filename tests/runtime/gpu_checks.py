"""The GPU variant of the method tests: the same checkpoints through the engine on a
CUDA device, with CUDA graphs, counting graph replays (``make test-gpu``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
"""Marks of a GPU test."""


def gpu_engine(target: Path, method: str | None, draft: Path | None, k: int, **config):
    """A float32 engine on ``cuda`` with CUDA graphs (``max_num_seqs`` 3 by default)."""
    from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig
    from specula.runtime.engine.llm_engine import LLMEngine

    speculator = None
    if method is not None:
        speculator = SpeculatorRuntimeConfig(
            method=method,
            model=None if draft is None else f"file://{draft}",
            num_speculative_tokens=k,
            **config.pop("speculator", {}),
        )
    runtime = RuntimeConfig(
        model=f"file://{target}",
        dtype="float32",
        max_num_seqs=config.pop("max_num_seqs", 3),
        speculator=speculator,
        **config,
    )
    return LLMEngine.from_config(runtime, device="cuda")


def check_greedy_on_gpu(
    engine,
    prompts: list[list[int]],
    expected: list[list[int]],
    ks,
    max_tokens: int,
    replayed: tuple[str, ...] = ("num_prefill_replays", "num_decode_replays"),
    ignore_eos: bool = True,
) -> None:
    """Greedy output equals ``expected`` for every k in ``ks`` (drafts accepted and
    rejected when k > 0), and the target's graphs and the speculator's graphs named by
    its replay counters ``replayed`` were replayed (counted, not flagged). Without
    ``ignore_eos``, requests stop at eos as ``expected`` (``generate``'s default) did."""
    from specula.runtime.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    stats = engine.spec_decoding_stats
    for k in ks:
        if engine.speculator is not None:
            engine.set_num_speculative_tokens(k)
        before = (stats.num_draft_tokens, stats.num_accepted_tokens)
        got = engine.generate(prompts, params)
        assert got == expected, f"k={k}"
        if engine.speculator is not None and k > 0:
            drafted = stats.num_draft_tokens - before[0]
            accepted = stats.num_accepted_tokens - before[1]
            assert 0 < accepted < drafted, f"k={k}: accepted {accepted} of {drafted}"
    assert engine.graphs is not None and engine.graphs.num_replays > 0
    for counter in replayed:
        assert getattr(engine.speculator, counter) > 0, counter
