"""Log-probabilities from the engine against ``transformers``' own logits: greedy
requests get the log-softmax of the target's raw logits at every emitted position, with
and without a speculator (accepted drafts, bonus and recovered tokens alike); sampled
requests that of the logits their temperature divides; prompt log-probabilities come
from the whole prompt's prefill even when its prefix is cached."""

from __future__ import annotations

import pytest
import torch

from specula.runtime.engine.llm_engine import SamplingParams

pytestmark = pytest.mark.runtime

PROMPTS = [[5, 17, 42, 99, 3, 250, 64], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


def _hf_logprobs(hf, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[len(ids), vocab] log-softmax of ``transformers``' logits at each position."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return (logits / temperature).log_softmax(-1)


def _run(engine, prompt: list[int], params: SamplingParams):
    """Step one request to the end: (tokens, per-token logprobs, prompt logprobs)."""
    engine.add_request("r", prompt, params)
    tokens, logprobs, prompt_lp = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
            logprobs += out.logprobs
            if out.prompt_logprobs is not None:
                assert prompt_lp is None
                prompt_lp = out.prompt_logprobs
    return tokens, logprobs, prompt_lp


@pytest.mark.parametrize("with_draft", [False, True])
def test_greedy_logprobs_match_transformers(make_engine, hf_model, tiny_llama_target,
                                            tiny_llama_draft, with_draft):
    engine = make_engine(tiny_llama_target, tiny_llama_draft if with_draft else None, k=3)
    hf = hf_model(tiny_llama_target)
    for prompt in PROMPTS:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5,
                                prompt_logprobs=3)
        tokens, logprobs, prompt_lp = _run(engine, prompt, params)
        ref = _hf_logprobs(hf, prompt + tokens)
        for j, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            row = ref[len(prompt) - 1 + j]
            assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
            top_ids = [t for t, _ in lp.top]
            assert top_ids[0] == token  # greedy: the argmax ranks first
            assert top_ids == row.topk(5).indices.tolist()
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)
            assert values == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)
        assert prompt_lp is not None and len(prompt_lp) == len(prompt) and prompt_lp[0] is None
        for j in range(1, len(prompt)):
            assert prompt_lp[j].logprob == pytest.approx(ref[j - 1][prompt[j]].item(), abs=1e-4)
            assert [t for t, _ in prompt_lp[j].top] == ref[j - 1].topk(3).indices.tolist()
    if with_draft:
        stats = engine.spec_decoding_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_sampled_logprobs_are_the_tempered_distribution(make_engine, hf_model,
                                                        tiny_llama_target, tiny_llama_draft):
    engine = make_engine(tiny_llama_target, tiny_llama_draft, k=3)
    hf = hf_model(tiny_llama_target)
    prompt = PROMPTS[0]
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=3, ignore_eos=True, logprobs=4)
    tokens, logprobs, prompt_lp = _run(engine, prompt, params)
    assert prompt_lp is None
    ref = _hf_logprobs(hf, prompt + tokens, temperature=0.7)
    ranked_in = 0
    for j, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        row = ref[len(prompt) - 1 + j]
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert [t for t, _ in lp.top] == row.topk(4).indices.tolist()
        if token in row.topk(4).indices.tolist():
            ranked_in += 1
            assert (token, pytest.approx(lp.logprob)) in lp.top
    assert 0 < ranked_in
    # Asking for log-probabilities changes no token.
    plain = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.7, seed=3,
                                                     ignore_eos=True))[0]
    assert plain == tokens


def test_prompt_logprobs_skip_the_prefix_cache(make_engine, hf_model, tiny_llama_target):
    engine = make_engine(tiny_llama_target, None, max_model_len=128)
    hf = hf_model(tiny_llama_target)
    prompt = list(range(1, 40))
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))  # cache it
    hits = engine.scheduler.block_manager.prefix_cache_hits
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1, prompt_logprobs=0)
    _, _, prompt_lp = _run(engine, prompt, params)
    assert engine.scheduler.block_manager.prefix_cache_hits == hits
    ref = _hf_logprobs(hf, prompt)
    assert [lp.logprob for lp in prompt_lp[1:]] == pytest.approx(
        [ref[j - 1][prompt[j]].item() for j in range(1, len(prompt))], abs=1e-4)
