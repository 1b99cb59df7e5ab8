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
    tiny_llama_target, tiny_llama_draft, hf_model, sampled_pvalue, make_engine
):
    torch.manual_seed(0)
    engine = make_engine(tiny_llama_target, tiny_llama_draft, k=3, max_num_seqs=256)
    hf = hf_model(tiny_llama_target)
    assert sampled_pvalue(engine, hf, PROMPT, NUM_SAMPLES) > ALPHA


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
