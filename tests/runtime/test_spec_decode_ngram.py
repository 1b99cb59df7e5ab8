"""n-gram prompt lookup (method ``ngram``): the lookup itself on hand-built sequences,
greedy output equal to ``transformers``' greedy ``generate`` for k = 1..8, and sampled
output keeping the target's distribution (chi-square at significance level ALPHA)."""

from __future__ import annotations

import argparse

import pytest
import torch

from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig
from specula.runtime.engine.llm_engine import LLMEngine, SamplingParams
from specula.runtime.server.cli import build_runtime_config
from specula.runtime.spec_decode.ngram import PAD_TOKEN_ID, NgramSpeculator, ngram_lookup

pytestmark = pytest.mark.runtime

ALPHA = 0.001
NUM_SAMPLES = 2000
MAX_TOKENS = 24
BASE_LENS = (3, 6, 9, 14)


# ---- the lookup ---------------------------------------------------------------------


def find_ngram_draft(seq: list[int], lookup_min: int, lookup_max: int, k: int) -> list[int]:
    """:func:`ngram_lookup` of one sequence, in a row wider than it (the engine's token
    history has room for more tokens)."""
    tokens = torch.tensor([seq + [PAD_TOKEN_ID] * 5])
    drafts, num = ngram_lookup(tokens, torch.tensor([len(seq)]), lookup_min, lookup_max, k)
    return drafts[0, : int(num[0])].tolist()


def test_longest_ngram_is_preferred():
    # The last 1-gram (3) recurs most recently at index 6 (followed by 9), but the
    # 2-gram (2, 3) recurs at index 1 (followed by 4, 5).
    seq = [1, 2, 3, 4, 5, 8, 3, 9, 2, 3]
    assert find_ngram_draft(seq, 1, 3, k=2) == [4, 5]
    assert find_ngram_draft(seq, 1, 1, k=2) == [9, 2]


def test_most_recent_occurrence_wins():
    seq = [7, 1, 10, 7, 1, 11, 12, 7, 1]
    assert find_ngram_draft(seq, 1, 2, k=3) == [11, 12, 7]


def test_no_match_proposes_nothing():
    assert find_ngram_draft([1, 2, 3, 4], 1, 4, k=3) == []
    # A 1-gram recurs, but min n = 2 does not allow it.
    assert find_ngram_draft([5, 1, 6, 1], 2, 3, k=3) == []
    assert find_ngram_draft([5], 1, 4, k=3) == []


def test_draft_is_truncated_at_sequence_end():
    # The match ends one token before the suffix: only what follows it, up to the end.
    seq = [4, 5, 6, 4, 5]
    assert find_ngram_draft(seq, 1, 4, k=8) == [6, 4, 5]
    # Overlapping occurrence: a run of one token proposes more of it.
    assert find_ngram_draft([3, 9, 9, 9], 1, 4, k=5) == [9]
    assert find_ngram_draft([3, 9, 9, 9], 1, 1, k=5) == [9]


def test_batched_lookup_pads_and_reports_draft_lengths():
    seqs = [[1, 2, 3, 1, 2], [1, 2, 3], [6, 7, 6, 7, 6, 7, 6, 7, 6]]
    tokens = torch.zeros(3, 12, dtype=torch.long)
    for i, seq in enumerate(seqs):
        tokens[i, : len(seq)] = torch.tensor(seq)
    drafts, num = ngram_lookup(tokens, torch.tensor([len(s) for s in seqs]), 1, 3, 4)
    # Row 2: the most recent earlier (6, 7, 6) starts two tokens before the suffix, so
    # only two tokens follow it.
    assert num.tolist() == [3, 0, 2]
    assert drafts.tolist() == [
        [3, 1, 2, PAD_TOKEN_ID], [PAD_TOKEN_ID] * 4, [7, 6, PAD_TOKEN_ID, PAD_TOKEN_ID]
    ]
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramSpeculator(4, prompt_lookup_min=3, prompt_lookup_max=2)


def test_config_defaults_and_validation():
    assert SpeculatorRuntimeConfig(method="ngram").prompt_lookup_range == (1, 4)
    assert SpeculatorRuntimeConfig(method="ngram", prompt_lookup_min=6).prompt_lookup_range == (
        6, 6
    )
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculatorRuntimeConfig(method="ngram", prompt_lookup_min=5, prompt_lookup_max=2)
    config = build_runtime_config(
        argparse.Namespace(model="file:///m", speculator_method="ngram", num_speculative_tokens=5)
    )
    assert config.speculator is not None and config.speculator.model is None
    assert config.speculator.method == "ngram"


# ---- end to end ---------------------------------------------------------------------


def _hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _repetitive_prompt(hf, base: list[int]) -> list[int]:
    """``base``, the target's greedy continuation of it, then ``base`` again: the lookup
    then finds text the target is likely (not certain) to produce again."""
    return base + _hf_greedy(hf, base, 8) + base


def _ngram_engine(target, k: int, max_num_seqs: int = 8, **lookup) -> LLMEngine:
    return LLMEngine.from_config(RuntimeConfig(
        model=f"file://{target}",
        dtype="float32",
        max_num_seqs=max_num_seqs,
        speculator=SpeculatorRuntimeConfig(method="ngram", num_speculative_tokens=k, **lookup),
    ))


def test_greedy_ngram_equals_hf_generate(tiny_llama_target, hf_model, greedy_rounds):
    hf = hf_model(tiny_llama_target)
    gen = torch.Generator().manual_seed(21)
    prompts = [
        _repetitive_prompt(hf, torch.randint(1, hf.config.vocab_size, (n,), generator=gen).tolist())
        for n in BASE_LENS
    ]
    expected = [_hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    # Fewer slots than prompts: the last prompt waits and joins a running batch.
    engine = _ngram_engine(tiny_llama_target, 8, max_num_seqs=3)
    assert engine.get_speculative_config()["method"] == "ngram"
    assert engine.get_speculative_config()["model"] is None
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for r in greedy_rounds(engine, prompts, expected, params, ks=range(1, 9)):
        # Lookup may find fewer than k tokens, never more.
        assert r.num_draft_tokens <= r.k * r.num_drafts, f"k={r.k}"
        assert r.num_generation_tokens == sum(len(g) for g in r.outputs), f"k={r.k}"


@pytest.mark.gpu
def test_greedy_ngram_on_gpu(tiny_llama_target, hf_model):
    from gpu_checks import check_greedy_on_gpu, gpu_engine

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    hf = hf_model(tiny_llama_target)
    gen = torch.Generator().manual_seed(21)
    prompts = [
        _repetitive_prompt(hf, torch.randint(1, hf.config.vocab_size, (n,), generator=gen).tolist())
        for n in BASE_LENS
    ]
    expected = [_hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    engine = gpu_engine(tiny_llama_target, "ngram", None, k=8)
    check_greedy_on_gpu(
        engine, prompts, expected, ks=(0, 2, 8), max_tokens=MAX_TOKENS, replayed=(),
        ignore_eos=False,
    )


def test_requests_without_a_match_draft_nothing(tiny_llama_target, hf_model):
    """A prompt of distinct tokens and a 4-gram minimum: rounds where no request finds a
    match decode plainly and count no draft; output stays the target's greedy output."""
    hf = hf_model(tiny_llama_target)
    prompt = list(range(1, 12))
    engine = _ngram_engine(tiny_llama_target, 4, prompt_lookup_min=4, prompt_lookup_max=4)
    got = engine.generate([prompt], SamplingParams(max_tokens=8))
    assert got == [_hf_greedy(hf, prompt, 8)]
    stats = engine.spec_decoding_stats
    # Fewer drafts than decode rounds (7 after the prefill's token), and never a draft
    # token unaccounted for.
    assert stats.num_drafts < 7
    assert stats.num_draft_tokens <= 4 * stats.num_drafts


def test_sampled_ngram_keeps_target_distribution(
    tiny_llama_target, hf_model, sampled_pvalue
):
    hf = hf_model(tiny_llama_target)
    # Built so that lookup finds likely text: the target's greedy continuation of the
    # whole prompt is what follows the earlier 46 (found by fixed-point iteration on
    # this checkpoint; checked here so a changed checkpoint fails loudly, not silently).
    prompt = [17, 42, 99, 46, 169, 289, 121, 7, 250, 5, 6, 46]
    assert _hf_greedy(hf, prompt, 3) == prompt[4:7]
    engine = _ngram_engine(tiny_llama_target, 3, max_num_seqs=256)
    assert sampled_pvalue(engine, hf, prompt, NUM_SAMPLES) > ALPHA


def test_prefix_caching_keeps_greedy_output(tiny_llama_target, hf_model, prefix_cached):
    prompts_for, run = prefix_cached
    hf = hf_model(tiny_llama_target)
    prompts = [_repetitive_prompt(hf, p) for p in prompts_for(hf.config.vocab_size, seed=25)]
    expected = [_hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    engine = _ngram_engine(tiny_llama_target, 4, max_num_seqs=3)
    assert run(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS)) == expected
    assert engine.spec_decoding_stats.num_accepted_tokens > 0
