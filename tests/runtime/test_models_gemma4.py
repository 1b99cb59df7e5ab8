"""Our paged Gemma4 text runner (the kernels' torch references on the CPU) equals
``transformers``' model on the same checkpoint (float32, within ``ATOL``).

- Logits: a batched prefill longer than the sliding window, incremental decoding,
  verification of ``k + 1`` tokens and overwritten rejected positions
  (:func:`check_runner_against_hf`); and a schedule with a *mixed* forward (two
  requests decode while a third prefills, KV-shared layers reading this forward's keys
  for the prefill rows and the cache for the decode rows) and a three-request
  verification, every query row compared. Two checkpoints: the 6-layer one with
  KV-shared layers, ``attention_k_eq_v``, proportional RoPE, per-layer inputs,
  double-wide MLPs and soft-capping; a 2-layer one without those, with a SiLU MLP (the
  fused SiLU kernel's path) and an untied head.
- KV sharing: shared layers read the cache entry of the last non-shared layer of their
  type (the entries a forward reads, checked against ``transformers``' own store/reuse
  marks), only non-shared layers own storage, each shaped by its type; the bytes a
  Gemma 4 E2B cache block takes, with and without sharing.
- Refusals: a shared layer type without a producer (at config load), a cache of the
  wrong shapes or dtype, and the mixture-of-experts Gemma4 (not served: the runner and
  the engine refuse it, naming ``enable_moe_block``).
- Greedy generation through the engine equals ``transformers``' ``generate``; a
  ``Gemma4ForConditionalGeneration`` checkpoint serves its text model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gemma4_checkpoints import SLIDING_WINDOW, gemma4_text_config, save, tiny_gemma4
from model_checks import (
    ATOL,
    BLOCK_SIZE,
    CPU,
    check_runner_against_hf,
    cpu_runner,
    hf_logits,
    paged_prefill,
)
from paged_schedule import run_schedule

from specula.runtime.engine.llm_engine import SamplingParams
from specula.runtime.models.config import ModelConfig
from specula.runtime.models.gemma4 import Gemma4ForCausalLM
from specula.runtime.models.gemma4_config import Gemma4ModelConfig
from specula.runtime.models.registry import load_model
from specula.runtime.worker import create_model_runner
from specula.runtime.worker.gemma4_runner import Gemma4Runner
from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache

pytestmark = pytest.mark.runtime

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def gemma4_shared(tmp_path_factory, tiny_tokenizer):
    """6 layers, the last 2 KV-shared; PLE, k_eq_v, double-wide MLPs, soft-capping."""
    model = tiny_gemma4(len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=10)
    return save(model, tiny_tokenizer, tmp_path_factory.mktemp("gemma4-shared"))


@pytest.fixture(scope="module")
def gemma4_plain(tmp_path_factory, tiny_tokenizer):
    """2 layers (sliding, full), no KV sharing, no PLE, separate K and V, SiLU MLP,
    untied head, no soft-capping."""
    model = tiny_gemma4(
        len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=12,
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=0, hidden_size_per_layer_input=0, attention_k_eq_v=False,
        use_double_wide_mlp=False, tie_word_embeddings=False, final_logit_softcapping=None,
        hidden_activation="silu",
    )
    return save(model, tiny_tokenizer, tmp_path_factory.mktemp("gemma4-plain"))


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory, tiny_tokenizer):
    """3 layers, no KV sharing, no PLE, untied LM head, experts beside each MLP."""
    model = tiny_gemma4(
        len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=11,
        num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention",
                                          "full_attention"],
        num_kv_shared_layers=0, hidden_size_per_layer_input=0, attention_k_eq_v=False,
        tie_word_embeddings=False, final_logit_softcapping=None,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
    )
    return save(model, tiny_tokenizer, tmp_path_factory.mktemp("gemma4-moe"))


CHECKPOINTS = ["gemma4_shared", "gemma4_plain"]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_logits_match_transformers(checkpoint, request, hf_model):
    """Prefill longer than the sliding window, decode, verify, overwrite."""
    path = request.getfixturevalue(checkpoint)
    hf = hf_model(path)
    runner = cpu_runner(path, MAX_MODEL_LEN)
    assert isinstance(runner, Gemma4Runner)
    check_runner_against_hf(runner, hf, hf.config.vocab_size, lens=(5, 3 * SLIDING_WINDOW + 1))


# Prompts longer and shorter than the window; the late one joins in a mixed forward.
PROMPTS = ([5, 17, 42, 7, 99, 3, 8, 61, 2, 11, 90, 23, 4], [3, 1, 4])
LATE_PROMPT = [7, 70, 2, 9, 33, 4, 5, 81]
DRAFTS = ([11, 12, 13], [21, 22, 23], [31, 32, 33])  # k = 3 per request


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_mixed_and_verification_steps_match_transformers(checkpoint, request, hf_model):
    """Prefill, 2 decode steps, a mixed step (requests 0 and 1 decode while request 2
    prefills) and a 3-request verification step on scattered blocks; every query row's
    logits against ``transformers``' forward over the whole sequence."""
    path = request.getfixturevalue(checkpoint)
    runner = cpu_runner(path, MAX_MODEL_LEN)
    manager = runner.kv_cache.block_manager(watermark=0.0)
    tokens, logits = run_schedule(
        runner, manager, PROMPTS, LATE_PROMPT, DRAFTS, decode_steps=2, warm_tokens=9,
        device=CPU,
    )
    assert [len(t) for t in tokens] == [13 + 3 + 4, 3 + 3 + 4, 8 + 4]
    assert min(len(t) for t in tokens) > SLIDING_WINDOW
    hf = hf_model(path)
    for r, (toks, rows) in enumerate(zip(tokens, logits, strict=True)):
        assert sorted(rows) == list(range(len(toks)))
        ours = torch.stack([rows[p] for p in range(len(toks))])
        torch.testing.assert_close(
            ours, hf_logits(hf, toks), atol=ATOL, rtol=0, msg=lambda m, r=r: f"request {r}: {m}"
        )


def test_shared_layers_read_the_last_producer_of_their_type(gemma4_shared, hf_model):
    hf = hf_model(gemma4_shared)
    runner = cpu_runner(gemma4_shared, MAX_MODEL_LEN, num_blocks=8)
    assert isinstance(runner, Gemma4Runner)
    model = runner.model
    config = model.config
    # transformers marks each type's last non-shared layer "store" and shared ones "reuse".
    modes = hf.config.kv_sharing_modes
    store = {hf.config.layer_types[i]: i for i, m in enumerate(modes) if m == "store"}
    expected = [
        store[t] if m == "reuse" else i
        for i, (t, m) in enumerate(zip(hf.config.layer_types, modes, strict=True))
    ]
    assert list(runner.kv_sources) == expected == [0, 1, 2, 3, 3, 2]
    assert runner.windows == (SLIDING_WINDOW, SLIDING_WINDOW, None) * 2
    for i, layer in enumerate(model.model.layers):
        assert hasattr(layer.self_attn, "k_proj") == (modes[i] != "reuse")
    # Only non-shared layers own storage, each shaped by its type.
    cache = runner.kv_cache
    shapes = [(2, 16), (2, 16), (1, 32), (2, 16)]  # (kv_heads, head_dim)
    assert cache.spec.layer_shapes == config.kv_cache_shapes() == tuple(shapes)
    assert len(cache.spec.layer_shapes) == len(cache.key_caches) == len(cache.value_caches) == 4
    for kc, vc, (h, d) in zip(cache.key_caches, cache.value_caches, shapes, strict=True):
        assert kc.shape == vc.shape == (8, BLOCK_SIZE, h, d)
    allocated = sum(t.nbytes for t in cache.key_caches + cache.value_caches)
    assert allocated == 8 * cache.spec.bytes_per_block == 8 * 2 * BLOCK_SIZE * (3 * 32 + 32) * 4

    # The entries one forward reads, layer by layer: shared layers read their producers'.
    reads: list[int] = []
    layer = cache.layer

    def spy(i: int):
        reads.append(i)
        return layer(i)

    cache.layer = spy  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(1, hf.config.vocab_size, (SLIDING_WINDOW + 3,), generator=gen)
    hidden, _ = paged_prefill(runner, prompt)
    assert reads == [0, 1, 2, 3, 3, 2]
    torch.testing.assert_close(
        runner.compute_logits(hidden), hf_logits(hf, prompt.tolist()), atol=ATOL, rtol=0
    )


def test_greedy_generation_matches_hf_generate(gemma4_shared, hf_model, hf_greedy, make_engine):
    hf = hf_model(gemma4_shared)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, hf.config.vocab_size, (n,), generator=gen).tolist()
               for n in (3, 9, 2 * SLIDING_WINDOW + 3)]
    # Two slots for three prompts: the last one joins a running batch.
    engine = make_engine(gemma4_shared, max_num_seqs=2)
    got = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(hf, prompt, 20), f"prompt length {len(prompt)}"


# Gemma 4 E2B's text config (google/gemma-4-E2B, config.json "text_config"): 35 layers
# in a 4:1 sliding:full pattern, 1 KV head everywhere, head_dim 256 (sliding) and
# global_head_dim 512 (full), the last 20 layers KV-shared.
E2B = dict(
    num_hidden_layers=35,
    layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
    num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
    num_kv_shared_layers=20, hidden_size=1536, intermediate_size=6144,
    sliding_window=512, hidden_size_per_layer_input=256, use_double_wide_mlp=True,
)


def test_kv_bytes_per_block_of_gemma4_e2b():
    config = ModelConfig.from_hf_config(gemma4_text_config(262144, 1, **E2B))
    assert isinstance(config, Gemma4ModelConfig)
    bf16, block = 2, 16
    sliding, full = 2 * 1 * 256 * bf16, 2 * 1 * 512 * bf16  # K and V, one KV head
    # Layers 0..14 own KV: 12 sliding and 3 full (4, 9, 14); 15..34 read layers 13 and 14.
    spec = KVCacheSpec.from_model_config(config, torch.bfloat16, block)
    assert len(spec.layer_shapes) == 15
    assert spec.bytes_per_block == block * (12 * sliding + 3 * full) == block * 18432
    unshared = dataclasses.replace(config, num_kv_shared_layers=0)
    unshared_spec = KVCacheSpec.from_model_config(unshared, torch.bfloat16, block)
    assert len(unshared_spec.layer_shapes) == 35
    assert unshared_spec.bytes_per_block == block * (28 * sliding + 7 * full) == block * 43008
    assert config.kv_source_layers()[15:20] == (13, 13, 13, 13, 14)
    # A real cache allocates exactly that per block.
    cache = PagedKVCache(spec, num_blocks=2, device=CPU)
    assert len(cache.key_caches) == 15
    assert sum(t.nbytes for t in cache.key_caches + cache.value_caches) == 2 * block * 18432


def test_llama_configs_keep_one_kv_entry_per_layer(tiny_llama_target):
    config = ModelConfig.from_pretrained(tiny_llama_target)
    assert config.kv_cache_shapes() == ((2, 16),) * 3
    spec = KVCacheSpec.from_model_config(config, torch.float32, BLOCK_SIZE)
    assert spec.layer_shapes == ((2, 16),) * 3
    assert spec.bytes_per_block == BLOCK_SIZE * 3 * 2 * 2 * 16 * 4


def test_shared_type_without_producer_fails_at_load(tiny_tokenizer):
    # Every non-shared layer is sliding, but shared layer 3 is full attention.
    hf = gemma4_text_config(
        len(tiny_tokenizer), tiny_tokenizer.eos_token_id, num_hidden_layers=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], num_kv_shared_layers=2,
    )
    with pytest.raises(ValueError, match=r"layer 3 \(full_attention\) is KV-shared"):
        ModelConfig.from_hf_config(hf)


def test_runner_refuses_caches_that_do_not_fit(gemma4_shared):
    model = load_model(gemma4_shared, torch.float32, CPU)
    # One shape for all 6 layers (a Llama-style cache), not the per-layer shapes.
    uniform = KVCacheSpec(((2, 16),) * 6, BLOCK_SIZE, torch.float32)
    with pytest.raises(ValueError, match="per-layer KV shapes"):
        Gemma4Runner(model, PagedKVCache(uniform, 2, CPU), MAX_MODEL_LEN)
    bf16 = KVCacheSpec.from_model_config(model.config, torch.bfloat16, BLOCK_SIZE)
    with pytest.raises(ValueError, match="KV cache dtype torch.bfloat16 != model dtype"):
        Gemma4Runner(model, PagedKVCache(bf16, 2, CPU), MAX_MODEL_LEN)


def test_mixture_of_experts_is_refused(gemma4_moe, make_engine):
    """The MoE Gemma4 is not served: the engine refuses the checkpoint at load, and
    the paged runner refuses the model, both naming the config field."""
    config = ModelConfig.from_pretrained(gemma4_moe)
    assert isinstance(config, Gemma4ModelConfig) and config.enable_moe_block
    with pytest.raises(ValueError, match="enable_moe_block is true"):
        make_engine(gemma4_moe)
    # The model classes hold no expert weights: build the (dense part of the) model
    # from the config to reach the runner's own check.
    model = Gemma4ForCausalLM(config, CPU).eval()
    spec = KVCacheSpec.from_model_config(config, torch.float32, BLOCK_SIZE)
    with pytest.raises(ValueError, match="enable_moe_block is true"):
        create_model_runner(model, PagedKVCache(spec, 2, CPU), MAX_MODEL_LEN)


def test_conditional_generation_checkpoint_loads_its_text_model(tmp_path, tiny_tokenizer):
    """A ``Gemma4ForConditionalGeneration`` checkpoint (how Gemma 4 is published, here
    with a vision tower whose weights are skipped) gives its text model's logits."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = tiny_gemma4(len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=16)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4,
                  position_embedding_size=64)
    text_config = text.config.to_dict() | {"pad_token_id": 0}
    hf = Gemma4ForConditionalGeneration(
        Gemma4Config(text_config=text_config, vision_config=vision, audio_config=None)
    ).eval()
    hf.model.language_model.load_state_dict(text.model.state_dict())
    path = save(hf, tiny_tokenizer, tmp_path / "gemma4-mm")
    runner = cpu_runner(path, MAX_MODEL_LEN)
    assert isinstance(runner.model, Gemma4ForCausalLM)
    assert runner.model.config.architecture == "Gemma4ForConditionalGeneration"
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, len(tiny_tokenizer), (2 * SLIDING_WINDOW,), generator=gen).tolist()
    hidden, _ = paged_prefill(runner, torch.tensor(prompt))
    logits = runner.compute_logits(hidden)
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, hf_logits(text, prompt), atol=ATOL, rtol=0)
