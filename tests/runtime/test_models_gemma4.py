"""Our Gemma4 text model equals ``transformers``' on the same checkpoint (float32):
batched prefill longer than the sliding window, incremental decoding, overwritten
rolled-back positions, KV-shared layers (which get no KV-cache storage), the
mixture-of-experts variant, greedy generation; and the KV memory sharing saves."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gemma4_checkpoints import SLIDING_WINDOW, gemma4_text_config, save, tiny_gemma4
from model_checks import ATOL, CPU, check_runner_against_hf, cpu_runner, hf_logits

from specula.runtime.engine.kv_cache import KVCache, kv_cache_bytes_per_token
from specula.runtime.engine.llm_engine import SamplingParams
from specula.runtime.engine.model_runner import ModelRunner
from specula.runtime.models.config import ModelConfig
from specula.runtime.models.gemma4 import Gemma4ForCausalLM
from specula.runtime.models.gemma4_config import Gemma4ModelConfig
from specula.runtime.models.registry import load_model

pytestmark = pytest.mark.runtime

@pytest.fixture(scope="module")
def gemma4_shared(tmp_path_factory, tiny_tokenizer):
    """6 layers, the last 2 KV-shared; PLE, k_eq_v, double-wide MLPs, soft-capping."""
    model = tiny_gemma4(len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=10)
    return save(model, tiny_tokenizer, tmp_path_factory.mktemp("gemma4-shared"))


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory, tiny_tokenizer):
    """3 layers, no KV sharing, no PLE, untied LM head, experts beside each MLP, 8:1
    default proportional RoPE share."""
    model = tiny_gemma4(
        len(tiny_tokenizer), tiny_tokenizer.eos_token_id, seed=11,
        num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention",
                                          "full_attention"],
        num_kv_shared_layers=0, hidden_size_per_layer_input=0, attention_k_eq_v=False,
        tie_word_embeddings=False, final_logit_softcapping=None,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
    )
    return save(model, tiny_tokenizer, tmp_path_factory.mktemp("gemma4-moe"))


@pytest.mark.parametrize("checkpoint", ["gemma4_shared", "gemma4_moe"])
def test_logits_match_transformers(checkpoint, request, hf_model):
    """Prefill longer than the sliding window; the rolled-back request is request 1."""
    path = request.getfixturevalue(checkpoint)
    hf = hf_model(path)
    check_runner_against_hf(
        cpu_runner(path), hf, hf.config.vocab_size,
        lens=(5, 3 * SLIDING_WINDOW + 1), slots=(3, 1), rollback_request=1,
    )


def test_shared_layers_read_the_last_producer_of_their_type(gemma4_shared, hf_model):
    hf = hf_model(gemma4_shared)
    runner = cpu_runner(gemma4_shared)
    model = runner.model
    assert isinstance(model, Gemma4ForCausalLM)
    config = model.config
    # transformers marks each type's last non-shared layer "store" and shared ones "reuse".
    modes = hf.config.kv_sharing_modes
    store = {hf.config.layer_types[i]: i for i, m in enumerate(modes) if m == "store"}
    expected = [
        store[t] if m == "reuse" else i
        for i, (t, m) in enumerate(zip(hf.config.layer_types, modes, strict=True))
    ]
    assert list(model.kv_sources) == expected == [0, 1, 2, 3, 3, 2]
    for i, layer in enumerate(model.model.layers):
        assert hasattr(layer.self_attn, "k_proj") == (modes[i] != "reuse")
    # Only non-shared layers own storage, each shaped by its type.
    cache = runner.kv_cache
    assert len(cache.layers) == cache.num_layers == 4
    shapes = [tuple(k.shape[1::2]) for k, _ in cache.layers]  # (kv_heads, head_dim)
    assert shapes == [(2, 16), (2, 16), (1, 32), (2, 16)]
    assert config.kv_cache_shapes() == tuple(shapes)


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


def test_kv_bytes_per_token_of_gemma4_e2b():
    config = ModelConfig.from_hf_config(gemma4_text_config(262144, 1, **E2B))
    assert isinstance(config, Gemma4ModelConfig)
    bf16 = 2
    sliding, full = 2 * 1 * 256 * bf16, 2 * 1 * 512 * bf16  # K and V, one KV head
    # Layers 0..14 own KV: 12 sliding and 3 full (4, 9, 14); 15..34 read layers 13 and 14.
    assert kv_cache_bytes_per_token(config, torch.bfloat16) == 12 * sliding + 3 * full == 18432
    unshared = dataclasses.replace(config, num_kv_shared_layers=0)
    assert kv_cache_bytes_per_token(unshared, torch.bfloat16) == 28 * sliding + 7 * full == 43008
    assert config.kv_source_layers()[15:20] == (13, 13, 13, 13, 14)
    # A real cache allocates exactly that per position and slot.
    cache = KVCache(config, max_num_seqs=1, max_len=8, dtype=torch.bfloat16, device=CPU)
    assert len(cache.layers) == 15
    assert sum(k.nbytes + v.nbytes for k, v in cache.layers) == 8 * 18432


def test_llama_configs_keep_one_kv_entry_per_layer(tiny_llama_target):
    config = ModelConfig.from_pretrained(tiny_llama_target)
    assert config.kv_cache_shapes() == ((2, 16),) * 3
    assert kv_cache_bytes_per_token(config, torch.float32) == 3 * 2 * 2 * 16 * 4


def test_shared_type_without_producer_fails_at_load(tiny_tokenizer):
    # Every non-shared layer is sliding, but shared layer 3 is full attention.
    hf = gemma4_text_config(
        len(tiny_tokenizer), tiny_tokenizer.eos_token_id, num_hidden_layers=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], num_kv_shared_layers=2,
    )
    with pytest.raises(ValueError, match=r"layer 3 \(full_attention\) is KV-shared"):
        ModelConfig.from_hf_config(hf)


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
    model = load_model(path, torch.float32, CPU)
    assert model.config.architecture == "Gemma4ForConditionalGeneration"
    runner = ModelRunner(model, max_num_seqs=1, max_len=32, device=CPU)
    prompt = torch.randint(1, len(tiny_tokenizer), (2 * SLIDING_WINDOW,)).tolist()
    logits = runner.compute_logits(runner.forward([0], torch.tensor(prompt), [len(prompt)], [0]))
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, hf_logits(text, prompt), atol=ATOL, rtol=0)
