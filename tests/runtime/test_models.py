"""Our Llama/Qwen3 forward equals ``transformers``' on the same checkpoint (float32),
for batched prefill of different lengths, incremental decoding with the KV cache, mixed
query lengths, and overwriting rolled-back positions; with an explicit split-K setting
(``attn_num_splits``) too, which reaches every paged-attention call."""

from __future__ import annotations

import pytest
import torch
from model_checks import (
    ATOL,
    BLOCK_SIZE,
    CPU,
    check_runner_against_hf,
    cpu_runner,
    hf_logits,
    paged_prefill,
)

from specula.runtime.models.registry import load_model
from specula.runtime.worker import model_runner
from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache

pytestmark = pytest.mark.runtime


def _check_against_hf(runner, hf, vocab: int) -> None:
    check_runner_against_hf(runner, hf, vocab, lens=(7, 12))


@pytest.mark.parametrize(
    "checkpoint", ["tiny_llama_target", "tiny_qwen3_target", "tiny_llama_draft"]
)
def test_logits_match_transformers(checkpoint, request, hf_model):
    path = request.getfixturevalue(checkpoint)
    hf = hf_model(path)
    _check_against_hf(cpu_runner(path), hf, hf.config.vocab_size)


def test_explicit_attn_num_splits_reaches_paged_attention(monkeypatch, tiny_qwen3_target, hf_model):
    """A runner built with ``attn_num_splits=3`` hands 3 to every paged-attention call
    (decode and verification rows) and still matches ``transformers``. On the CPU the
    attention is the kernel's reference, which has no splits; the split-K kernel itself
    is checked against that reference in ``kernels/test_kernel_paged_attention.py``."""
    calls: list[int | None] = []
    paged_attention = model_runner.paged_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("num_splits"))
        return paged_attention(*args, **kwargs)

    monkeypatch.setattr(model_runner, "paged_attention", spy)
    model = load_model(tiny_qwen3_target, torch.float32, CPU)
    spec = KVCacheSpec.from_model_config(model.config, torch.float32, BLOCK_SIZE)
    runner = model_runner.ModelRunner(
        model, PagedKVCache(spec, 64, CPU), max_model_len=64, attn_num_splits=3
    )
    hf = hf_model(tiny_qwen3_target)
    _check_against_hf(runner, hf, hf.config.vocab_size)
    # Decode steps, the verification and the overwrite after it, in every layer.
    assert len(calls) >= 3 * model.config.num_hidden_layers and set(calls) == {3}


def test_llama_variants_match_transformers(tmp_path, tiny_tokenizer):
    """Attention/MLP biases, tied embeddings, llama3 rope scaling and a long prompt
    (its own attention group) also match."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        initializer_range=0.1,
        rope_theta=50000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # biases are zero-initialised; make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    runner = cpu_runner(tmp_path)
    _check_against_hf(runner, hf, config.vocab_size)

    tokens = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = runner.compute_logits(paged_prefill(runner, torch.tensor(tokens))[0])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_missing_weights_are_reported(tmp_path, tiny_llama_target):
    from safetensors.torch import load_file, save_file

    for f in tiny_llama_target.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    state = load_file(tiny_llama_target / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks.*model.layers.1.self_attn.qkv_proj.weight"):
        load_model(tmp_path, torch.float32, CPU)
