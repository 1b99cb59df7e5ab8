"""Greedy speculative decoding emits exactly ``transformers``' greedy tokens, for every
k in 1..8 and a batch of prompts of different lengths, with a draft that differs from
the target (so rejections and acceptances both happen)."""

from __future__ import annotations

import pytest
import torch

from specula.runtime.engine.llm_engine import SamplingParams

pytestmark = pytest.mark.runtime

MAX_TOKENS = 24
PROMPT_LENS = (3, 9, 17, 30)


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Avoid the eos id (0) in prompts; generation may still produce it.
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("family", "ks"), [("llama", range(1, 9)), ("qwen3", (1, 3, 8))], ids=["llama", "qwen3"]
)
def test_greedy_speculative_equals_hf_generate(
    family, ks, request, hf_model, make_engine, greedy_rounds
):
    target = request.getfixturevalue(f"tiny_{family}_target")
    draft = request.getfixturevalue(f"tiny_{family}_draft")
    hf = hf_model(target)
    prompts = _prompts(hf.config.vocab_size, seed=11)
    expected = [_hf_greedy(hf, p) for p in prompts]
    # Fewer slots than prompts: the last prompt waits and joins a running batch.
    engine = make_engine(target, draft, k=8, max_num_seqs=3)
    greedy_rounds(engine, prompts, expected, SamplingParams(max_tokens=MAX_TOKENS), ks)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft_model", "target-only"])
def test_greedy_on_gpu_in_cuda_graphs(family, with_draft, request, hf_model):
    from gpu_checks import check_greedy_on_gpu, gpu_engine

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    target = request.getfixturevalue(f"tiny_{family}_target")
    draft = request.getfixturevalue(f"tiny_{family}_draft") if with_draft else None
    hf = hf_model(target)
    prompts = _prompts(hf.config.vocab_size, seed=11)
    expected = [_hf_greedy(hf, p) for p in prompts]
    engine = gpu_engine(target, "draft_model" if with_draft else None, draft, k=8)
    check_greedy_on_gpu(
        engine, prompts, expected, ks=(0, 1, 4, 8) if with_draft else (0,),
        max_tokens=MAX_TOKENS, ignore_eos=False,
        replayed=("num_prefill_replays", "num_decode_replays") if with_draft else (),
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_greedy_draft_model_screens_its_head(device, tiny_llama_target, tiny_llama_draft, monkeypatch):
    """A bfloat16 greedy ``draft_model`` drafts through its head's 8-bit screen, built at load
    (not for probabilistic drafting): the same drafts as the unscreened head's, so the same
    tokens and accepted counts (on the GPU, from the kernels in the CUDA graphs)."""
    from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig
    from specula.runtime.engine.llm_engine import LLMEngine
    from specula.runtime.spec_decode import draft_model
    from specula.runtime.worker import model_runner

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")

    def build(sample: str = "greedy"):
        spec = SpeculatorRuntimeConfig(method="draft_model", model=f"file://{tiny_llama_draft}",
                                       num_speculative_tokens=4, draft_sample_method=sample)
        config = RuntimeConfig(model=f"file://{tiny_llama_target}", dtype="bfloat16", max_num_seqs=3,
                               speculator=spec)
        return LLMEngine.from_config(config, device=device)

    calls = []
    screened = model_runner.screened_argmax
    monkeypatch.setattr(model_runner, "screened_argmax", lambda *a: calls.append(1) or screened(*a))
    prompts = _prompts(320, seed=13)  # the tiny vocabulary
    runs = []
    for screen in (True, False):
        if not screen:
            monkeypatch.setattr(draft_model, "screen_weight", lambda weight: None)
        calls.clear()
        engine = build()
        head = engine.speculator.model.lm_head_screen
        assert (head is not None and head[0].dtype == torch.int8) == screen
        got = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        assert bool(calls) == screen  # on the GPU, at capture
        runs.append((got, engine.spec_decoding_stats.num_accepted_tokens))
    assert runs[0] == runs[1] and runs[0][1] > 0
    assert build("probabilistic").speculator.model.lm_head_screen is None


def test_without_speculator_equals_hf_generate(tiny_llama_target, hf_model, make_engine):
    hf = hf_model(tiny_llama_target)
    prompts = _prompts(hf.config.vocab_size, seed=12)
    engine = make_engine(tiny_llama_target)
    assert engine.get_speculative_config()["method"] is None
    got = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert got == [_hf_greedy(hf, p) for p in prompts]
    assert engine.generation_tokens_total == sum(len(g) for g in got)
    assert engine.spec_decoding_stats.num_drafts == 0


def test_k_changes_between_steps(tiny_llama_target, tiny_llama_draft, hf_model, make_engine):
    """k = 0 turns speculation off; switching k mid-request keeps the output exact (the
    draft catches up over tokens it skipped)."""
    hf = hf_model(tiny_llama_target)
    prompts = _prompts(hf.config.vocab_size, seed=13)[:2]
    expected = [_hf_greedy(hf, p) for p in prompts]
    engine = make_engine(tiny_llama_target, tiny_llama_draft, k=4)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS))
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    schedule = [0, 0, 4, 0, 2, 3, 1, 0, 4]
    step = 0
    while engine.has_unfinished_requests():
        engine.set_num_speculative_tokens(schedule[step % len(schedule)])
        step += 1
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert [got["r0"], got["r1"]] == expected
    assert 0 < engine.spec_decoding_stats.num_drafts


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_every_proposal_is_the_drafts_greedy_continuation(
    family, request, hf_model, make_engine, hf_greedy
):
    """Each draft the engine proposes (k = 4, over prefills, acceptances, rejections and
    a mixed batch) is the draft model's own greedy continuation of the request's verified
    tokens: the draft's KV cache stays exact although its prefill runs only for prompts
    (verified drafts keep the KV they were drafted with)."""
    from hidden_state_drafts import record_proposals

    target = request.getfixturevalue(f"tiny_{family}_target")
    draft = request.getfixturevalue(f"tiny_{family}_draft")
    draft_hf = hf_model(draft)
    engine = make_engine(target, draft, k=4, max_num_seqs=3)
    log = record_proposals(engine)
    prompts = _prompts(draft_hf.config.vocab_size, seed=14)
    engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert len(log) >= 10
    stats = engine.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for tokens, drafts in log:
        assert drafts == hf_greedy(draft_hf, tokens, 4), f"context of {len(tokens)}"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft_model", "target-only"])
def test_prefix_caching_keeps_greedy_output(
    family, with_draft, request, hf_model, make_engine, prefix_cached
):
    """Requests that reuse a cached prompt prefix (prefilled after it, alone or in a
    mixed batch) still emit ``transformers``' greedy tokens; the draft model's KV of
    the shared blocks is the one written with them."""
    prompts_for, run = prefix_cached
    target = request.getfixturevalue(f"tiny_{family}_target")
    hf = hf_model(target)
    prompts = prompts_for(hf.config.vocab_size, seed=21)
    expected = [_hf_greedy(hf, p) for p in prompts]
    if with_draft:
        draft = request.getfixturevalue(f"tiny_{family}_draft")
        engine = make_engine(target, draft, k=4, max_num_seqs=3)
    else:
        engine = make_engine(target, max_num_seqs=3)
    assert run(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS)) == expected
