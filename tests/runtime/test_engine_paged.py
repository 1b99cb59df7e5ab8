"""The engine's paging and batching on the CPU (the kernels' torch references, the code
path ``make demo`` runs): a KV pool small enough to preempt, a block size of 4.

Against Hugging Face ``transformers`` greedy ``generate`` on the same checkpoint:
greedy output is the target's token for token, with drafts accepted and rejected, with
requests admitted while others decode (mixed prefill/decode forwards), and with a KV
pool so small that running requests are preempted and recomputed. Sampling: top-k 1
at a positive temperature takes the random path of the rejection-sampling kernel and
must still give the greedy tokens; two requests with the same seed give the same tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hidden_state_drafts import (
    VOCAB_SIZE,
    bigram_eagle3_head,
    draft_vocab_ids,
    save_bigram_target,
    save_speculators,
)

pytestmark = pytest.mark.runtime

K = 3
BLOCK_SIZE = 4
MAX_MODEL_LEN = 32


def run_gpu_engine(
    target: Path,
    draft: Path | None,
    prompts: list[list[int]],
    params: list[dict],
    *,
    max_num_seqs: int,
    num_gpu_blocks: int,
    method: str = "eagle3",
    device: str = "cpu",
    async_scheduling: bool | None = None,
) -> dict:
    """Serve ``prompts`` with a float32 :class:`LLMEngine` on ``device``; returns outputs,
    counters and each step's (decode, prefill) request counts."""
    from transformers import AutoTokenizer

    from specula.api.runtime_config import SpeculatorRuntimeConfig
    from specula.runtime.engine.llm_engine import LLMEngine
    from specula.runtime.engine.sampling_params import SamplingParams

    spec = None
    if draft is not None:
        spec = SpeculatorRuntimeConfig(
            method=method, model=f"file://{draft}", num_speculative_tokens=K
        )
    engine = LLMEngine(
        target,
        AutoTokenizer.from_pretrained(str(target)),
        served_model_name="t",
        speculator_config=spec,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max_num_seqs,
        device=device,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=num_gpu_blocks,
        async_scheduling=async_scheduling,
    )
    steps: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recording(*args):
        out = schedule(*args)
        steps.append((len(out.decode), len(out.prefill)))
        return out

    engine.scheduler.schedule = recording
    outputs = engine.generate(prompts, [SamplingParams(**p) for p in params])
    stats = engine.spec_decoding_stats
    bm = engine.scheduler.block_manager
    return {
        "outputs": outputs,
        "steps": steps,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "num_preemptions": engine.scheduler.num_preemptions,
        "free_blocks_after": bm.num_free_blocks,
        "num_blocks": bm.num_blocks,
    }


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_tokenizer) -> Path:
    return save_bigram_target("llama", tiny_tokenizer, tmp_path_factory.mktemp("target"), 5)


@pytest.fixture(scope="module")
def target_hf(target):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def draft(tmp_path_factory, target_hf) -> Path:
    head = bigram_eagle3_head(target_hf, draft_vocab_ids(seed=1, size=288), seed=2)
    return save_speculators(head, tmp_path_factory.mktemp("eagle3"), keep_embeddings=False)


PROMPT_LENS = (3, 9, 17, 5)
MAX_TOKENS_PER_PROMPT = (6, 12, 8, 10)
"""Different lengths, so that requests finish at different steps and waiting ones are
admitted while others still decode (few, short requests)."""


def _prompts(seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _greedy(max_tokens) -> list[dict]:
    return [{"max_tokens": n, "ignore_eos": True} for n in max_tokens]


def _expected(hf_greedy, target_hf, prompts, max_tokens) -> list[list[int]]:
    return [hf_greedy(target_hf, p, n) for p, n in zip(prompts, max_tokens, strict=True)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_eagle3_greedy_matches_transformers_with_mixed_batches_and_preemption(
    target, target_hf, draft, hf_greedy, async_scheduling
):
    prompts = _prompts(seed=11)
    # 14 blocks of 4 tokens: not all requests (and their 4-slot lookahead) fit at once,
    # so admission waits for blocks and running requests get preempted.
    got = run_gpu_engine(
        target,
        draft,
        prompts,
        _greedy(MAX_TOKENS_PER_PROMPT),
        max_num_seqs=3,
        num_gpu_blocks=14,
        async_scheduling=async_scheduling,
    )
    assert got["outputs"] == _expected(hf_greedy, target_hf, prompts, MAX_TOKENS_PER_PROMPT)
    assert any(d and p for d, p in got["steps"]), f"no mixed step in {got['steps']}"
    assert got["num_preemptions"] > 0
    assert max(d + p for d, p in got["steps"]) <= 3
    assert 0 < got["num_accepted_tokens"] < got["num_draft_tokens"]
    assert got["free_blocks_after"] == got["num_blocks"]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_target_only_greedy_matches_transformers(target, target_hf, hf_greedy, async_scheduling):
    prompts = _prompts(seed=12)[:3]
    max_tokens = MAX_TOKENS_PER_PROMPT[:3]
    got = run_gpu_engine( target, None, prompts, _greedy(max_tokens),
        max_num_seqs=2, num_gpu_blocks=32, async_scheduling=async_scheduling,
    )
    assert got["outputs"] == _expected(hf_greedy, target_hf, prompts, max_tokens)
    assert any(d and p for d, p in got["steps"]), f"no mixed step in {got['steps']}"
    assert got["num_draft_tokens"] == 0
    assert got["free_blocks_after"] == got["num_blocks"]


def test_sampling_paths(target, target_hf, draft, hf_greedy):
    prompts = _prompts(seed=13)[:2]
    n = 6
    # top-k 1 at temperature 0.8: the kernel's random path, with a one-hot target
    # distribution, must accept exactly the greedy drafts and emit the greedy tokens.
    top1 = [{"max_tokens": n, "temperature": 0.8, "top_k": 1, "ignore_eos": True, "seed": 3}]
    # Two requests with one seed in one batch: the same tokens.
    seeded = {"max_tokens": n, "temperature": 1.0, "top_p": 0.9, "ignore_eos": True}
    params = top1 * 2 + [dict(seeded, seed=7), dict(seeded, seed=7)]
    got = run_gpu_engine(
        target,
        draft,
        prompts + [prompts[1], prompts[1]],
        params,
        max_num_seqs=4,
        num_gpu_blocks=32,
    )
    outputs = got["outputs"]
    assert outputs[:2] == _expected(hf_greedy, target_hf, prompts, (n, n))
    assert outputs[2] == outputs[3]
    assert len(outputs[2]) == n and all(0 <= t < VOCAB_SIZE for t in outputs[2])
    assert 0 < got["num_accepted_tokens"] < got["num_draft_tokens"]


@pytest.mark.parametrize("method", [None, "gemma4_mtp", "draft_model"],
                         ids=["target-only", "gemma4_mtp", "gemma4_draft_model"])
def test_gemma4_greedy_matches_transformers(tiny_tokenizer, tmp_path, hf_greedy, method):
    """A Gemma4 target with sliding-window and KV-shared layers (the window shorter than
    the contexts), alone, with its MTP assistant reading its KV, or with itself as
    its draft model (its runner's argmax into the drafts), with a request admitted while
    another decodes."""
    import torch
    from gemma4_checkpoints import save, tiny_gemma4, tiny_gemma4_assistant
    from transformers import AutoModelForCausalLM

    shape = dict(sliding_window=3, num_attention_heads=2, num_key_value_heads=1)
    model = tiny_gemma4(len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=10, **shape)
    path = save(model, tiny_tokenizer, tmp_path / "gemma4")
    draft = None
    if method == "gemma4_mtp":
        draft = save(tiny_gemma4_assistant(model, seed=12), tiny_tokenizer, tmp_path / "assistant")
    elif method == "draft_model":  # the target as its own draft: its drafts are accepted
        draft = path
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(seed=14)[:3]
    max_tokens = (4, 7, 5)
    got = run_gpu_engine(path, draft, prompts, _greedy(max_tokens),
                         max_num_seqs=2, num_gpu_blocks=32, method=method or "gemma4_mtp")
    assert got["outputs"] == _expected(hf_greedy, hf, prompts, max_tokens)
    assert any(d and p for d, p in got["steps"]), f"no mixed step in {got['steps']}"
    assert got["free_blocks_after"] == got["num_blocks"]
    if method == "gemma4_mtp":
        assert 0 < got["num_accepted_tokens"] < got["num_draft_tokens"]
    elif method == "draft_model":
        assert got["num_accepted_tokens"] > 0
