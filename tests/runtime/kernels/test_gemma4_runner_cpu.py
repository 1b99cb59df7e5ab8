"""The paged Gemma4 runner on the CPU (its Triton kernels in the interpreter, in the
``interpreted`` worker) against Hugging Face ``transformers`` on the same checkpoint.

One schedule per checkpoint, the logits of every query row (prompt positions
included) compared with ``transformers``' forward over the whole sequence (float32, 1e-4 absolute, as the Llama
runner's test):

1. a varlen prefill of two requests, one longer than the sliding window (banded causal
   mask) and one shorter;
2. a greedy decode step;
3. a mixed step: both running requests decode while a third request prefills;
4. a verification step, ``k + 1 = 4`` query tokens for each of the three requests.

Contexts reach 11 tokens against a window of 3, so sliding layers' paged reads skip
keys, and the block manager hands out scattered blocks of 4 slots. Checkpoints (from
``gemma4_checkpoints``): the 6-layer one with KV-shared layers 4 and 5 (reading layers
3 and 2), ``attention_k_eq_v``, proportional RoPE, per-layer inputs, double-wide MLPs
and soft-capping; and a 2-layer one without those extras, with a SiLU MLP (the fused
SiLU kernel), an untied head, and attention split over two programs.
"""

from __future__ import annotations

import pytest
import torch
from gemma4_checkpoints import gemma4_text_config, save, tiny_gemma4
from paged_schedule import run_schedule

from specula.runtime.worker.gemma4_runner import Gemma4Runner
from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache
from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache
from specula.runtime.models.gemma4 import Gemma4ForCausalLM
from specula.runtime.models.gemma4_config import Gemma4ModelConfig
from specula.runtime.models.registry import load_model

pytestmark = pytest.mark.runtime

BLOCK_SIZE = 4
MAX_MODEL_LEN = 32
WINDOW = 3
"""Shorter than the checkpoints' default: short sequences (few interpreted programs)
still cross it."""
PROMPTS = ([5, 17, 42, 7, 99], [3, 1])  # 5 > window > 2
LATE_PROMPT = [7, 70, 2, 9]
DRAFTS = ([11, 12, 13], [21, 22, 23], [31, 32, 33])  # k = 3 per request
CPU = torch.device("cpu")


def run_paged(checkpoint: str, num_splits: int | None) -> tuple[list[list[int]], list[dict]]:
    """The schedule of the module docstring on the paged runner; returns each request's
    tokens and, per request, ``{position: logits}`` for every computed position."""
    model = load_model(checkpoint, torch.float32, CPU)
    spec = KVCacheSpec.from_model_config(model.config, torch.float32, BLOCK_SIZE)
    cache = PagedKVCache(spec, num_blocks=24, device=CPU)
    runner = Gemma4Runner(model, cache, MAX_MODEL_LEN, attn_num_splits=num_splits)
    manager = cache.block_manager(watermark=0.0)
    return run_schedule(
        runner, manager, PROMPTS, LATE_PROMPT, DRAFTS, decode_steps=1, warm_tokens=9, device=CPU
    )


def _check_against_hf(hf, tokens, logits) -> None:
    for toks, rows in zip(tokens, logits, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([toks])).logits[0]  # [seq_len, vocab]
        positions = sorted(rows)
        assert positions == list(range(len(toks)))
        ours = torch.stack([rows[p] for p in positions])
        torch.testing.assert_close(ours, ref[positions].float(), atol=1e-4, rtol=0)


# Fewer heads than the model tests' checkpoints: the interpreter runs one program per
# normed head row.
SMALL = dict(sliding_window=WINDOW, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def gemma4_shared(tmp_path_factory, tiny_tokenizer):
    model = tiny_gemma4(len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=10, **SMALL)
    return save(model, tiny_tokenizer, tmp_path_factory.mktemp("gemma4-shared"))


@pytest.fixture(scope="module")
def gemma4_plain(tmp_path_factory, tiny_tokenizer):
    model = tiny_gemma4(
        len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=12,
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=0, hidden_size_per_layer_input=0, attention_k_eq_v=False,
        use_double_wide_mlp=False, tie_word_embeddings=False, final_logit_softcapping=None,
        hidden_activation="silu", **SMALL,
    )
    return save(model, tiny_tokenizer, tmp_path_factory.mktemp("gemma4-plain"))


def test_kv_shared_checkpoint_matches_transformers(interpreted, gemma4_shared, hf_model):
    tokens, logits = interpreted(run_paged, str(gemma4_shared), None)
    assert [len(t) for t in tokens] == [5 + 2 + 4, 2 + 2 + 4, 4 + 4]
    assert min(len(t) for t in tokens) > 2 * WINDOW
    _check_against_hf(hf_model(gemma4_shared), tokens, logits)


def test_plain_checkpoint_matches_transformers(interpreted, gemma4_plain, hf_model):
    tokens, logits = interpreted(run_paged, str(gemma4_plain), 2)
    _check_against_hf(hf_model(gemma4_plain), tokens, logits)


def test_cache_owns_storage_for_non_shared_layers_only(gemma4_shared):
    model = load_model(gemma4_shared, torch.float32, CPU)
    spec = KVCacheSpec.from_model_config(model.config, torch.float32, BLOCK_SIZE)
    # Layers 0, 1, 3 sliding (1 KV head of 16), layer 2 full (1 of 32); 4 and 5 none.
    assert spec.layer_shapes == ((1, 16), (1, 16), (1, 32), (1, 16))
    cache = PagedKVCache(spec, num_blocks=3, device=CPU)
    assert [tuple(k.shape) for k in cache.key_caches] == [
        (3, BLOCK_SIZE, h, d) for h, d in spec.layer_shapes
    ]
    pairs = zip(cache.key_caches, cache.value_caches, strict=True)
    allocated = sum(k.nbytes + v.nbytes for k, v in pairs)
    assert allocated == 3 * spec.bytes_per_block == 3 * 2 * BLOCK_SIZE * (3 * 16 + 32) * 4
    runner = Gemma4Runner(model, cache, MAX_MODEL_LEN)
    assert runner.kv_sources == (0, 1, 2, 3, 3, 2)
    assert runner.windows == (WINDOW, WINDOW, None) * 2
    assert cache.block_manager().num_blocks == 3


def test_refuses_mismatched_caches_and_moe(gemma4_shared, tiny_tokenizer):
    model = load_model(gemma4_shared, torch.float32, CPU)
    uniform = KVCacheSpec.from_model_config(model.config, torch.float32, BLOCK_SIZE)
    with pytest.raises(ValueError, match="per-layer KV shapes"):
        Gemma4Runner(model, PagedKVCache(uniform, 2, CPU), MAX_MODEL_LEN)
    spec = KVCacheSpec.from_model_config(model.config, torch.bfloat16, BLOCK_SIZE)
    with pytest.raises(ValueError, match="dtype"):
        Gemma4Runner(model, PagedKVCache(spec, 2, CPU), MAX_MODEL_LEN)
    hf = gemma4_text_config(
        len(tiny_tokenizer), tiny_tokenizer.eos_token_id, num_hidden_layers=1,
        layer_types=["full_attention"], num_kv_shared_layers=0, enable_moe_block=True,
        num_experts=2, top_k_experts=1, moe_intermediate_size=8,
    )
    config = Gemma4ModelConfig.from_hf_config(hf)
    moe = Gemma4ForCausalLM(config, CPU)
    spec = KVCacheSpec.from_model_config(config, torch.float32, BLOCK_SIZE)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        Gemma4Runner(moe, PagedKVCache(spec, 2, CPU), MAX_MODEL_LEN)
