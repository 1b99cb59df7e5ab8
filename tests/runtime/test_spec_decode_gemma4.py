"""Gemma4 MTP (method ``gemma4_mtp``): a ``gemma4_assistant`` draft reading the
target's paged KV cache, run by the engine on the CPU (the kernels' torch references).

- Every proposal the engine makes (after prefills, after accepted and after rejected
  drafts, with a request prefilled while others verify) equals ``transformers``'
  ``Gemma4AssistantForCausalLM`` on the same weights and the request's verified tokens:
  draft logits of every step within ATOL, drafts equal to their greedy chain; dense and
  centroid-masked logits, a prompt longer than the sliding window.
- Greedy output equals ``transformers``' assisted generation and the target's greedy
  output for k = 1..8; sampled output keeps the target's distribution (chi-square at
  significance level ALPHA).
- A Gemma4 draft on a non-Gemma4 target, a non-assistant checkpoint and a backbone of
  the wrong size fail at load, naming the field.
"""

from __future__ import annotations

import pytest
import torch
from gemma4_checkpoints import (
    SLIDING_WINDOW,
    load_hf_assistant,
    save,
    tiny_gemma4,
    tiny_gemma4_assistant,
)
from hidden_state_drafts import record_proposals

from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig
from specula.runtime.engine.llm_engine import LLMEngine, SamplingParams
from specula.runtime.spec_decode.gemma4 import Gemma4MTPSpeculator

pytestmark = pytest.mark.runtime

ATOL = 1e-4
ALPHA = 0.001


@pytest.fixture(scope="module")
def hf_target(tiny_tokenizer):
    return tiny_gemma4(len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=10)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_tokenizer, hf_target):
    return save(hf_target, tiny_tokenizer, tmp_path_factory.mktemp("gemma4-target"))


@pytest.fixture(scope="module")
def assistant_dir(tmp_path_factory, tiny_tokenizer, hf_target):
    assistant = tiny_gemma4_assistant(hf_target, seed=12)
    return save(assistant, tiny_tokenizer, tmp_path_factory.mktemp("gemma4-assistant"))


@pytest.fixture(scope="module")
def ordered_assistant_dir(tmp_path_factory, tiny_tokenizer, hf_target):
    """Centroid-masked logits: 8 clusters of 40 tokens, the top 2 scored."""
    assistant = tiny_gemma4_assistant(
        hf_target, seed=13, use_ordered_embeddings=True, num_centroids=8,
        centroid_intermediate_top_k=2,
    )
    return save(assistant, tiny_tokenizer, tmp_path_factory.mktemp("gemma4-assistant-ordered"))


def _engine(target, draft, k: int, max_num_seqs: int = 8) -> LLMEngine:
    return LLMEngine.from_config(RuntimeConfig(
        model=f"file://{target}",
        dtype="float32",
        max_num_seqs=max_num_seqs,
        speculator=SpeculatorRuntimeConfig(
            method="gemma4_mtp", model=f"file://{draft}", num_speculative_tokens=k
        ),
    ))


def _hf_draft_logits(hf_target, hf_assistant, tokens: list[int], k: int) -> list[torch.Tensor]:
    """``transformers``' draft logits for the ``k`` tokens after ``tokens``, as its
    ``SinglePositionMultiTokenCandidateGenerator`` computes them: the target's shared KV
    and last hidden state over ``tokens[:-1]``, the last token at position
    ``len(tokens) - 1``, greedy draft tokens fed back with the assistant's projection."""
    committed, last = tokens[:-1], tokens[-1]
    embed = hf_target.get_input_embeddings()
    out = hf_target(
        torch.tensor([committed]), output_hidden_states=True, return_shared_kv_states=True
    )
    hidden, token = out.hidden_states[-1][:, -1:], torch.tensor([[last]])
    logits = []
    for _ in range(k):
        step = hf_assistant(
            inputs_embeds=torch.cat([embed(token), hidden], dim=-1),
            position_ids=torch.tensor([[len(tokens) - 1]]),
            shared_kv_states=out.shared_kv_states,
        )
        logits.append(step.logits[0, -1])
        token, hidden = step.logits.argmax(-1), step.last_hidden_state
    return logits


@pytest.mark.parametrize("draft", ["assistant_dir", "ordered_assistant_dir"])
def test_every_proposal_follows_transformers(draft, request, hf_target, target_dir):
    """Each proposal the engine makes (after a prefill, after accepted and after rejected
    drafts, whose KV the target's cache still holds past the draft rows' context) has,
    at every draft step, ``transformers``' draft logits on the request's verified tokens
    and their greedy chain as its drafts."""
    draft_dir = request.getfixturevalue(draft)
    hf_assistant = load_hf_assistant(draft_dir)
    k = 4
    # Two slots for three prompts: the last one is prefilled while the others verify.
    engine = _engine(target_dir, draft_dir, k, max_num_seqs=2)
    spec = engine.speculator
    assert isinstance(spec, Gemma4MTPSpeculator)
    log = record_proposals(engine)

    # Every draft step's logits, per request, in proposal order: [k, vocab] each.
    step_logits: list[torch.Tensor] = []
    by_request: dict[str, list[torch.Tensor]] = {}
    compute, propose = spec.compute_draft_logits, spec.propose

    def computing(hidden: torch.Tensor) -> torch.Tensor:
        step_logits.append(compute(hidden).clone())
        return step_logits[-1]

    mixed_steps = 0  # proposals after a forward that verified and prefilled

    def proposing(inputs):
        nonlocal mixed_steps
        step_logits.clear()
        out = propose(inputs)
        assert out is not None and len(step_logits) == k
        rows = inputs.idx_mapping.tolist()
        names = [engine.input_batch._requests[row].request_id for row in rows]
        fresh = [n not in by_request for n in names]
        mixed_steps += any(fresh) and not all(fresh)
        for i, request_id in enumerate(names):
            by_request.setdefault(request_id, []).append(torch.stack([s[i] for s in step_logits]))
        return out

    spec.compute_draft_logits = computing  # type: ignore[method-assign]
    spec.propose = proposing  # type: ignore[method-assign]

    gen = torch.Generator().manual_seed(0)
    vocab = hf_target.config.vocab_size
    # One prompt longer than the sliding window (plus the draft's one extra position).
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist()
               for n in (4, 2 * SLIDING_WINDOW + 5, 7)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert mixed_steps == 1

    def owner(seq: list[int]) -> str:
        (request_id,) = [i for i, p in zip(ids, prompts, strict=True) if seq[: len(p)] == p]
        return request_id

    seen = {i: 0 for i in ids}
    after_prefill = 0
    for seq, drafts in log:
        request_id = owner(seq)
        ours = by_request[request_id][seen[request_id]]
        seen[request_id] += 1
        after_prefill += len(seq) == len(prompts[ids.index(request_id)]) + 1
        with torch.no_grad():
            expected = _hf_draft_logits(hf_target, hf_assistant, seq, k)
        msg = f"request {request_id}, {len(seq)} verified tokens"
        assert drafts == [e.argmax().item() for e in expected], msg
        torch.testing.assert_close(
            ours, torch.stack(expected), atol=ATOL, rtol=0, msg=lambda m, msg=msg: f"{msg}: {m}"
        )
    # Every proposal but each request's last (made in the step it finished) was checked.
    assert seen == {i: len(by_request[i]) - 1 for i in ids}
    assert after_prefill == len(prompts)
    assert len(log) >= 2 * len(prompts)


def _hf_assisted(hf_target, hf_assistant, prompt: list[int], k: int, n: int) -> list[int]:
    hf_assistant.generation_config.num_assistant_tokens = k
    hf_assistant.generation_config.num_assistant_tokens_schedule = "constant"
    with torch.no_grad():
        out = hf_target.generate(
            torch.tensor([prompt]), assistant_model=hf_assistant, do_sample=False,
            max_new_tokens=n, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_equals_target_and_transformers_assisted_generation(
    hf_target, target_dir, assistant_dir, hf_greedy, greedy_rounds
):
    hf_assistant = load_hf_assistant(assistant_dir)
    gen = torch.Generator().manual_seed(3)
    vocab = hf_target.config.vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist()
               for n in (3, 7, 2 * SLIDING_WINDOW + 4)]
    max_tokens = 10
    expected = [hf_greedy(hf_target, p, max_tokens) for p in prompts]
    # Fewer slots than prompts: the last prompt waits and joins a running batch.
    engine = _engine(target_dir, assistant_dir, 8, max_num_seqs=2)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for r in greedy_rounds(engine, prompts, expected, params, ks=range(1, 9)):
        # transformers' assisted generation (batch size 1 only) on the longest prompt.
        got = _hf_assisted(hf_target, hf_assistant, prompts[-1], r.k, max_tokens)
        assert got == r.outputs[-1], f"k={r.k}"


def test_sampled_gemma4_mtp_keeps_target_distribution(
    hf_target, target_dir, assistant_dir, sampled_pvalue
):
    prompt = [17, 42, 99, 46, 169, 289, 121, 7]
    engine = _engine(target_dir, assistant_dir, 3, max_num_seqs=256)
    assert sampled_pvalue(engine, hf_target, prompt, num_samples=1200) > ALPHA


def test_gemma4_draft_on_non_gemma4_target_fails_at_load(tiny_llama_target, assistant_dir):
    with pytest.raises(ValueError, match=r"needs a Gemma4 target: target model_type 'llama'"):
        _engine(tiny_llama_target, assistant_dir, 2)


def test_non_assistant_checkpoint_fails_at_load(target_dir):
    with pytest.raises(ValueError, match=r"model_type 'gemma4_text' != 'gemma4_assistant'"):
        _engine(target_dir, target_dir, 2)


def test_backbone_size_mismatch_names_both_values(
    tmp_path, tiny_tokenizer, hf_target, target_dir
):
    other = tiny_gemma4(
        len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=14, hidden_size=32
    )
    draft = save(tiny_gemma4_assistant(other, seed=15), tiny_tokenizer, tmp_path / "d")
    with pytest.raises(ValueError, match="draft backbone_hidden_size 32 != target hidden_size 64"):
        _engine(target_dir, draft, 2)


def test_prefix_caching_keeps_greedy_output(
    hf_target, target_dir, assistant_dir, hf_greedy, prefix_cached
):
    """Gemma4 MTP reads the target's KV, sliding-window layers included: a prompt
    prefilled after a reused prefix longer than the window still decodes exactly."""
    prompts_for, run = prefix_cached
    prompts = prompts_for(hf_target.config.vocab_size, seed=26, prefix_len=2 * SLIDING_WINDOW + 8)
    expected = [hf_greedy(hf_target, p, 10) for p in prompts]
    engine = _engine(target_dir, assistant_dir, 4, max_num_seqs=2)
    assert run(engine, prompts, SamplingParams(max_tokens=10, ignore_eos=True)) == expected
