"""Sampled speculative decoding keeps the target's distribution, end to end.

The joint distribution of the first three generated tokens over many seeds is compared
with the exact distribution computed from ``transformers``' logits of the target (with the
same temperature and top-k applied by the test itself), by a chi-square goodness-of-fit
test at significance level ALPHA.
"""

from __future__ import annotations

import pytest
import torch

from specula.runtime.engine.llm_engine import SamplingParams

pytestmark = pytest.mark.runtime

ALPHA = 0.001
NUM_SAMPLES = 4000
PROMPT = [17, 42, 99, 7, 250]


def test_sampled_output_matches_target_distribution(
    tiny_llama_target, tiny_llama_draft, hf_model, target_pvalue, make_engine
):
    temperature, top_k, length, k = 0.9, 4, 3, 3
    torch.manual_seed(0)
    engine = make_engine(tiny_llama_target, tiny_llama_draft, k=k, max_num_seqs=256)
    params = [
        SamplingParams(
            max_tokens=length, temperature=temperature, top_k=top_k, seed=s, ignore_eos=True
        )
        for s in range(NUM_SAMPLES)
    ]
    outputs = engine.generate([PROMPT] * NUM_SAMPLES, params)
    stats = engine.spec_decoding_stats
    # Both the accept and the recover/bonus branches must have run for the test to mean much.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_accepted_tokens_per_pos[1] > 0

    hf = hf_model(tiny_llama_target)
    assert target_pvalue(hf, PROMPT, outputs, temperature, top_k, length) > ALPHA


def test_seeded_requests_are_reproducible_and_batch_independent(
    tiny_llama_target, tiny_llama_draft, make_engine
):
    engine = make_engine(tiny_llama_target, tiny_llama_draft, k=4, max_num_seqs=8)
    prompts = [PROMPT, PROMPT[:2], PROMPT * 3]
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in (5, 6, 7)]
    batched = engine.generate(prompts, params)
    alone = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert batched == alone
    other_seed = engine.generate(
        [prompts[0]], [SamplingParams(max_tokens=12, temperature=1.0, seed=99)]
    )
    assert other_seed[0] != batched[0]
