"""EAGLE-3 on a Gemma4 target (sliding-window and KV-shared layers, per-layer inputs,
soft-capped logits): the auxiliary hidden states come from the Gemma4 runner (vLLM PR
#39450 exposes them for Gemma4), the head shares the target's token embedding and
verifies through the same engine. Greedy output equals ``transformers``' for several k
with drafts both accepted and rejected; sampled output keeps the target distribution.

The head's draft vocabulary is the handful of tokens the target emits on the test
prompts (greedy, and every sample the chi-square test can draw), so a random head agrees
with the target often enough for the accept branch to run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gemma4_checkpoints import save, tiny_gemma4
from hidden_state_drafts import eagle3_head, save_speculators
from sampling_checks import exact_joint_probs

from specula.api.runtime_config import RuntimeConfig, SpeculatorRuntimeConfig
from specula.runtime.engine.llm_engine import LLMEngine, SamplingParams

pytestmark = pytest.mark.runtime

VOCAB_SIZE = 320
MAX_TOKENS = 12
AUX_IDS = (0, 3, 6)
"""The embedding output, the input of layer 3 and the last (KV-shared) layer's output."""
SAMPLING = {"temperature": 0.7, "top_k": 2, "length": 3}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(31)
    return [torch.randint(1, VOCAB_SIZE, (n,), generator=gen).tolist() for n in (3, 8, 15)]


@pytest.fixture(scope="module")
def target_hf(tiny_tokenizer):
    return tiny_gemma4(VOCAB_SIZE, tiny_tokenizer.eos_token_id, seed=21)


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_tokenizer, target_hf) -> Path:
    return save(target_hf, tiny_tokenizer, tmp_path_factory.mktemp("gemma4-target"))


@pytest.fixture(scope="module")
def expected(target_hf, hf_greedy) -> list[list[int]]:
    return [hf_greedy(target_hf, p, MAX_TOKENS) for p in _prompts()]


def _head(tmp_path_factory, target_hf, vocab: set[int]) -> Path:
    model = eagle3_head(
        target_hf, draft_vocab=torch.tensor(sorted(vocab)), seed=22, aux_ids=AUX_IDS
    )
    return save_speculators(model, tmp_path_factory.mktemp("eagle3"), keep_embeddings=False)


@pytest.fixture(scope="module")
def head(tmp_path_factory, target_hf, expected) -> Path:
    return _head(tmp_path_factory, target_hf, {t for out in expected for t in out})


@pytest.fixture(scope="module")
def sampling_head(tmp_path_factory, target_hf, expected) -> Path:
    """Drafts only among the target's greedy tokens after the sampling prompt (it
    settles into repeating one) and the first sampled token's two candidates: the
    drafts of the few contexts three sampled tokens reach are often right."""
    first = {seq[0] for seq in exact_joint_probs(target_hf, _prompts()[1], **SAMPLING)}
    return _head(tmp_path_factory, target_hf, set(expected[1][:3]) | first)


def _engine(
    target: Path, head: Path, k: int, max_num_seqs: int = 2, draft_sample_method: str = "greedy"
) -> LLMEngine:
    return LLMEngine.from_config(
        RuntimeConfig(
            model=f"file://{target}",
            dtype="float32",
            max_num_seqs=max_num_seqs,
            speculator=SpeculatorRuntimeConfig(
                method="eagle3",
                model=f"file://{head}",
                num_speculative_tokens=k,
                draft_sample_method=draft_sample_method,
            ),
        )
    )


def test_greedy_equals_transformers(target, head, expected, greedy_rounds):
    # Fewer slots than prompts: the last prompt waits and joins a running batch.
    engine = _engine(target, head, k=8)
    assert engine.aux_hidden_state_layers == AUX_IDS
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    greedy_rounds(engine, _prompts(), expected, params, ks=(1, 3, 8))


@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
def test_sampling_keeps_target_distribution(
    target, sampling_head, target_hf, sampled_pvalue, draft_sample_method
):
    engine = _engine(
        target, sampling_head, k=3, max_num_seqs=256, draft_sample_method=draft_sample_method
    )
    # A prompt whose likely continuations are in the draft vocabulary.
    pvalue = sampled_pvalue(engine, target_hf, _prompts()[1], num_samples=1200, **SAMPLING)
    assert pvalue > 0.001


@pytest.mark.gpu
@pytest.mark.parametrize("with_head", [True, False], ids=["eagle3", "target-only"])
def test_greedy_on_gpu_in_cuda_graphs(target, head, expected, with_head):
    from gpu_checks import check_greedy_on_gpu, gpu_engine

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    engine = gpu_engine(target, "eagle3" if with_head else None, head if with_head else None, k=8)
    check_greedy_on_gpu(
        engine, _prompts(), expected, ks=(0, 3, 8) if with_head else (0,), max_tokens=MAX_TOKENS,
        replayed=("num_prefill_replays", "num_decode_replays") if with_head else (),
    )


def test_prefix_caching_keeps_greedy_output(target, target_hf, head, hf_greedy, prefix_cached):
    prompts_for, run = prefix_cached
    prompts = prompts_for(target_hf.config.vocab_size, seed=27)
    expected = [hf_greedy(target_hf, p, MAX_TOKENS) for p in prompts]
    engine = _engine(target, head, k=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    assert run(engine, prompts, params) == expected
