"""The paged GPU model runner on the CPU (its Triton kernels in the interpreter, in the
``interpreted`` worker) against Hugging Face ``transformers`` on the same checkpoint:
a varlen prefill of two requests, greedy decode steps, and a (k + 1)-token verification
step, each position's logits compared with ``transformers``' forward over the whole
sequence.

Block size 4 and contexts of 5-15 tokens: every request spans several blocks, handed out
by the block manager after another request's blocks were freed, so block-table
indirection matters. Tolerance 1e-4 absolute on float32 logits (the kernels' float32
rotary table and online softmax vs ``transformers``' float32 math).
"""

from __future__ import annotations

import pytest
import torch

from specula.runtime.models.registry import load_model
from specula.runtime.worker.model_runner import ModelRunner
from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache, metadata_from_block_manager

pytestmark = pytest.mark.runtime

BLOCK_SIZE = 4
MAX_MODEL_LEN = 32
PROMPTS = ([5, 17, 42, 7, 99], [3, 1, 4, 1, 5, 9, 2])
DECODE_STEPS = 3
DRAFTS = ([11, 12, 13], [21, 22, 23])  # k = 3 draft tokens per request


def run_paged(checkpoint: str, num_splits: int | None) -> tuple[list[list[int]], list[dict]]:
    """Prefill, decode and verify on the paged runner; returns each request's tokens
    and, per request, ``{position: logits}`` for every position whose logits were
    computed."""
    device = torch.device("cpu")
    model = load_model(checkpoint, torch.float32, device)
    spec = KVCacheSpec.from_model_config(model.config, torch.float32, BLOCK_SIZE)
    cache = PagedKVCache(spec, num_blocks=24, device=device)
    runner = ModelRunner(model, cache, MAX_MODEL_LEN, attn_num_splits=num_splits)
    manager = cache.block_manager(watermark=0.0)
    # A request that comes and goes first, so the others get non-contiguous blocks.
    manager.allocate("warm", 9)
    ids = [0, 1]
    manager.allocate(0, len(PROMPTS[0]))
    manager.free("warm")
    manager.allocate(1, len(PROMPTS[1]))
    tokens = [list(p) for p in PROMPTS]
    logits: list[dict] = [{}, {}]

    def forward(query_lens: list[int], new_tokens: list[list[int]]) -> torch.Tensor:
        metadata, positions = metadata_from_block_manager(
            manager, ids, query_lens, runner.max_blocks_per_req, device
        )
        input_ids = torch.tensor([t for toks in new_tokens for t in toks])
        hidden, _ = runner.forward(input_ids, positions, metadata)
        return runner.compute_logits(hidden)

    # Varlen prefill; logits at each prompt's last token.
    out = forward([len(p) for p in PROMPTS], tokens)
    last = torch.tensor([len(PROMPTS[0]) - 1, len(PROMPTS[0]) + len(PROMPTS[1]) - 1])
    for r in ids:
        logits[r][len(tokens[r]) - 1] = out[last[r]]
    for _ in range(DECODE_STEPS):
        nxt = [int(logits[r][len(tokens[r]) - 1].argmax()) for r in ids]
        for r in ids:
            manager.append_slots(r, 1)
        out = forward([1, 1], [[t] for t in nxt])
        for r in ids:
            tokens[r].append(nxt[r])
            logits[r][len(tokens[r]) - 1] = out[r]
    # Verification: the next greedy token plus k draft tokens, k + 1 query tokens per
    # request, causal among themselves.
    bonus = [int(logits[r][len(tokens[r]) - 1].argmax()) for r in ids]
    verify = [[bonus[r], *DRAFTS[r]] for r in ids]
    for r in ids:
        manager.append_slots(r, len(verify[r]))
    out = forward([4, 4], verify)
    for r in ids:
        for j, t in enumerate(verify[r]):
            tokens[r].append(t)
            logits[r][len(tokens[r]) - 1] = out[4 * r + j]
    return tokens, logits


def _check_against_hf(hf, tokens, logits) -> None:
    for toks, rows in zip(tokens, logits, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([toks])).logits[0]  # [seq_len, vocab]
        positions = sorted(rows)
        assert positions[-1] == len(toks) - 1
        ours = torch.stack([rows[p] for p in positions])
        torch.testing.assert_close(ours, ref[positions].float(), atol=1e-4, rtol=0)


def test_llama_prefill_decode_verify_match_transformers(interpreted, tiny_llama_target, hf_model):
    tokens, logits = interpreted(run_paged, str(tiny_llama_target), None)
    assert [len(t) for t in tokens] == [len(p) + DECODE_STEPS + 4 for p in PROMPTS]
    _check_against_hf(hf_model(tiny_llama_target), tokens, logits)


def test_qwen3_prefill_decode_verify_match_transformers(interpreted, tiny_qwen3_target, hf_model):
    # Split-K: each request's context over three programs and the merge kernel.
    tokens, logits = interpreted(run_paged, str(tiny_qwen3_target), 3)
    _check_against_hf(hf_model(tiny_qwen3_target), tokens, logits)
