"""The paged Gemma4 MTP draft (its Triton kernels in the interpreter, in the
``interpreted`` worker) against the CPU assistant model on the same target KV.

The paged Gemma4 target prefills two requests (6 and 3 tokens, window 3); the draft
proposes ``k = 3`` greedy tokens from each request's sampled token; then the target
verifies ``[t, d_1, d_2, d_3]`` (writing KV for all four), one draft is taken as
accepted, and the draft proposes again from the state after it, where the target's
cache already holds KV of the rejected drafts that the draft must not read. The
reference is :class:`Gemma4AssistantForCausalLM`'s own forward (checked against
``transformers`` in the runtime tests) on the same keys and values gathered into a slot
cache, with the CPU speculator's metadata. Per step: logits within 1e-4 (float32),
tokens equal. The assistant uses centroid-masked logits (8 clusters, top 2).
"""

from __future__ import annotations

import pytest
import torch
from gemma4_checkpoints import save, tiny_gemma4, tiny_gemma4_assistant

from specula.runtime.spec_decode.gemma4.runner import Gemma4AssistantRunner
from specula.runtime.worker.gemma4_runner import Gemma4Runner
from specula.runtime.worker.paged_kv import metadata_from_block_manager
from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache
from specula.runtime.kernels.paged_attention import gather_kv
from specula.runtime.models.attention import build_attention_metadata, with_sliding_window
from specula.runtime.models.gemma4_assistant import load_gemma4_assistant
from specula.runtime.models.gemma4_config import SLIDING
from specula.runtime.models.registry import load_model

pytestmark = pytest.mark.runtime

CPU = torch.device("cpu")
BLOCK_SIZE = 4
MAX_MODEL_LEN = 32
K = 3
PROMPTS = ([5, 17, 42, 7, 99, 3], [3, 1, 4])
SMALL = dict(sliding_window=3, num_attention_heads=2, num_key_value_heads=1)


def _reference_draft(assistant, target, runner, block_table, tokens, backbone, positions):
    """The CPU assistant's greedy loop (as ``Gemma4MTPSpeculator.run_draft_model``) on
    the paged cache's keys and values gathered into a slot cache."""
    producers = target.config.kv_producer_layers()
    r = len(positions)
    caches = {}
    for layer_type in assistant.config.text.layer_types:
        entry = producers[layer_type]
        key_cache, value_cache = runner.kv_cache.layer(entry)
        n = max(positions)
        k = torch.zeros(r, key_cache.shape[2], n, key_cache.shape[3])
        v = torch.zeros_like(k)
        for i, p in enumerate(positions):
            k[i, :, :p] = gather_kv(key_cache, block_table, i, p).transpose(0, 1)
            v[i, :, :p] = gather_kv(value_cache, block_table, i, p).transpose(0, 1)
        caches[layer_type] = (k, v)
    metadata = build_attention_metadata(list(range(r)), [1] * r, [p - 1 for p in positions], CPU)
    by_type = {t: metadata for t in caches}
    if SLIDING in by_type:
        by_type[SLIDING] = with_sliding_window(metadata, assistant.sliding_window)
    pos = torch.tensor(positions)
    logits, drafts = [], []
    for _ in range(K):
        embeds = torch.cat([target.model.embed(tokens), backbone], dim=-1)
        hidden, backbone = assistant(embeds, pos, caches, by_type)
        logits.append(assistant.compute_logits(hidden))
        tokens = logits[-1].argmax(-1)
        drafts.append(tokens)
    return torch.stack(logits), torch.stack(drafts, dim=1)


def _paged_draft(draft, block_table, tokens, backbone, positions):
    pos = torch.tensor(positions)
    metadata = draft.draft_metadata(pos, block_table)
    logits, b = [], backbone
    t = tokens
    for _ in range(K):
        hidden, b = draft.step(t, b, pos, metadata)
        logits.append(draft.model.compute_logits(hidden))
        t = logits[-1].argmax(-1)
    drafts = draft.propose(tokens, backbone, pos, block_table, K)
    return torch.stack(logits), drafts


@torch.no_grad()
def run_drafts(target_dir: str, assistant_dir: str) -> list[tuple[torch.Tensor, ...]]:
    """``[(paged logits [K, r, V], reference logits, paged drafts [r, K], reference
    drafts)]`` after the prefill and after the verification."""
    target = load_model(target_dir, torch.float32, CPU)
    spec = KVCacheSpec.from_model_config(target.config, torch.float32, BLOCK_SIZE)
    runner = Gemma4Runner(target, PagedKVCache(spec, 16, CPU), MAX_MODEL_LEN)
    assistant = load_gemma4_assistant(assistant_dir, torch.float32, CPU)
    draft = Gemma4AssistantRunner(assistant, runner)
    manager = runner.kv_cache.block_manager(watermark=0.0)
    manager.allocate("warm", 5)
    manager.allocate(0, len(PROMPTS[0]))
    manager.free("warm")
    manager.allocate(1, len(PROMPTS[1]))
    ids = [0, 1]

    def forward(new_tokens):
        metadata, positions = metadata_from_block_manager(
            manager, ids, [len(t) for t in new_tokens], runner.max_blocks_per_req, CPU
        )
        hidden, _ = runner.forward(torch.tensor(sum(new_tokens, [])), positions, metadata)
        return metadata, hidden, runner.compute_logits(hidden)

    results = []
    metadata, hidden, logits = forward([list(p) for p in PROMPTS])
    last = runner.last_token_indices(metadata)
    tokens, backbone = logits[last].argmax(-1), hidden[last]
    positions = [len(p) for p in PROMPTS]
    block_table = metadata.block_table
    ours = _paged_draft(draft, block_table, tokens, backbone, positions)
    ref = _reference_draft(assistant, target, runner, block_table, tokens, backbone, positions)
    results.append((*ours[:1], ref[0], ours[1], ref[1]))

    # Verify [t, d_1, d_2, d_3]; take d_1 as accepted and the token after it as sampled.
    verify = [[int(tokens[r]), *ours[1][r].tolist()] for r in ids]
    for r in ids:
        manager.append_slots(r, K + 1)
    metadata, hidden, logits = forward(verify)
    rows = torch.tensor([r * (K + 1) + 1 for r in ids])
    tokens, backbone = logits[rows].argmax(-1), hidden[rows]
    positions = [p + 2 for p in positions]  # t and d_1 committed; the new token's position
    block_table = metadata.block_table
    ours = _paged_draft(draft, block_table, tokens, backbone, positions)
    ref = _reference_draft(assistant, target, runner, block_table, tokens, backbone, positions)
    results.append((*ours[:1], ref[0], ours[1], ref[1]))
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer):
    target = tiny_gemma4(len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=10, **SMALL)
    assistant = tiny_gemma4_assistant(
        target, seed=13, use_ordered_embeddings=True, num_centroids=8,
        centroid_intermediate_top_k=2,
    )
    root = tmp_path_factory.mktemp("gemma4-mtp")
    return (
        save(target, tiny_tokenizer, root / "target"),
        save(assistant, tiny_tokenizer, root / "assistant"),
    )


def test_paged_draft_matches_assistant_model(interpreted, checkpoints):
    target_dir, assistant_dir = checkpoints
    results = interpreted(run_drafts, str(target_dir), str(assistant_dir))
    assert len(results) == 2
    for ours, ref, our_drafts, ref_drafts in results:
        assert ours.shape == ref.shape and ours.shape[:2] == (K, 2)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
        assert torch.equal(our_drafts, ref_drafts)
