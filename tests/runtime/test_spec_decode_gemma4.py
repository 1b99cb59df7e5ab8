"""Gemma4 MTP (method ``gemma4_mtp``): a ``gemma4_assistant`` draft reading the
target's KV cache. Draft logits equal ``transformers``' ``Gemma4AssistantForCausalLM``
on the same weights and target state (dense and centroid-masked logits, after prefill
and after a verification round); greedy output equals ``transformers``' assisted
generation and the target's greedy output for k = 1..8; sampled output keeps the
target's distribution (chi-square at significance level ALPHA); a Gemma4 draft on a
non-Gemma4 target fails at load."""

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

from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig
from specula.runtime.engine.llm_engine import LLMEngine, SamplingParams
from specula.runtime.engine.model_runner import ModelRunner
from specula.runtime.engine.sampler import SamplingMetadata
from specula.runtime.models.config import ModelConfig
from specula.runtime.models.registry import load_model
from specula.runtime.spec_decode.base import SpeculatorInput, TargetHiddenStates
from specula.runtime.spec_decode.gemma4 import Gemma4MTPSpeculator

pytestmark = pytest.mark.runtime

ATOL = 1e-4
ALPHA = 0.001
CPU = torch.device("cpu")


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


class RecordingGemma4Speculator(Gemma4MTPSpeculator):
    """Keeps every draft step's logits ``[num_reqs, vocab]``."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.logits: list[torch.Tensor] = []

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.logits.append(super().compute_draft_logits(hidden))
        return self.logits[-1]


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
def test_draft_logits_match_transformers(draft, request, hf_target, target_dir):
    draft_dir = request.getfixturevalue(draft)
    hf_assistant = load_hf_assistant(draft_dir)
    runner = ModelRunner(load_model(target_dir, torch.float32, CPU), 4, 128, CPU)
    k = 4
    spec = RecordingGemma4Speculator(
        draft_dir=draft_dir, target_config=ModelConfig.from_pretrained(target_dir),
        num_speculative_tokens=k, max_num_seqs=4, max_model_len=120, dtype=torch.float32,
        device=CPU,
    )
    spec.bind_target(runner)
    greedy = SamplingMetadata.from_params([SamplingParams()] * 2, [None] * 2, CPU)
    gen = torch.Generator().manual_seed(0)
    vocab = hf_target.config.vocab_size
    # One prompt longer than the sliding window (plus the draft's one extra position).
    lens = [4, 2 * SLIDING_WINDOW + 5]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
    slots = [2, 0]

    hidden = runner.forward(slots, torch.tensor(prompts[0] + prompts[1]), lens, [0, 0])
    first = runner.compute_logits(hidden[[lens[0] - 1, sum(lens) - 1]]).argmax(-1).tolist()
    spec.add_requests(slots)
    spec.observe_target(TargetHiddenStates(slots, [0, 0], lens, hidden, None))
    seqs = [p + [t] for p, t in zip(prompts, first, strict=True)]

    for round_ in range(2):
        spec.logits.clear()
        proposal = spec.propose(SpeculatorInput(slots, seqs, greedy), k)
        drafts = proposal.draft_token_ids.tolist()
        assert len(spec.logits) == k
        for i, seq in enumerate(seqs):
            with torch.no_grad():
                expected = _hf_draft_logits(hf_target, hf_assistant, seq, k)
            for step in range(k):
                torch.testing.assert_close(
                    spec.logits[step][i], expected[step], atol=ATOL, rtol=0,
                    msg=lambda m, i=i, s=step, r=round_: f"round {r} request {i} step {s}: {m}",
                )
                assert drafts[i][step] == expected[step].argmax().item()
        if round_ == 1:
            break
        # Verify as the engine does: the target scores the last token and the drafts;
        # request 0 keeps one draft token, request 1 none (then its recovered token).
        starts = [len(s) - 1 for s in seqs]
        verify = [[s[-1], *d] for s, d in zip(seqs, drafts, strict=True)]
        hidden = runner.forward(slots, torch.tensor(verify).flatten(), [k + 1] * 2, starts)
        target_next = runner.compute_logits(hidden).argmax(-1).view(2, k + 1).tolist()
        accepted = [1, 0]
        spec.rollback(slots, [len(s) + a for s, a in zip(seqs, accepted, strict=True)])
        rows = torch.cat([hidden[i * (k + 1) : i * (k + 1) + a + 1] for i, a in enumerate(accepted)])
        spec.observe_target(TargetHiddenStates(slots, starts, [a + 1 for a in accepted], rows, None))
        seqs = [
            s + d[:a] + [nxt[a]]
            for s, d, a, nxt in zip(seqs, drafts, accepted, target_next, strict=True)
        ]


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
