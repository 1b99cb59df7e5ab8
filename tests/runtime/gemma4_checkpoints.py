"""Tiny random Gemma4 text and Gemma4 assistant (MTP draft) models, built by
``transformers`` for the Gemma4 runtime tests.

The shapes exercise everything the Gemma4 text model does: sliding and full layers with
different head sizes and KV heads, ``attention_k_eq_v``, proportional RoPE, per-layer
input embeddings, double-wide MLPs in KV-shared layers, ``num_kv_shared_layers``, final
logit soft-capping; norms and ``layer_scalar`` are perturbed away from their initial ones
so that loading them is checked too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

SLIDING_WINDOW = 6
"""Shorter than most test sequences, so the window mask matters."""

SHARED_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
"""Layers 4 (sliding) and 5 (full) are KV-shared; they read layers 3 and 2."""


def gemma4_text_config(vocab_size: int, eos_token_id: int, **overrides):
    """A tiny ``Gemma4TextConfig``: 6 layers, the last 2 KV-shared."""
    from transformers import Gemma4TextConfig

    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        layer_types=list(SHARED_LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        sliding_window=SLIDING_WINDOW,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=vocab_size,
        final_logit_softcapping=30.0,
        max_position_embeddings=256,
        initializer_range=0.2,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    fields.update(overrides)
    return Gemma4TextConfig(**fields)


def perturb_scales(model, seed: int, layer_gain: float) -> None:
    """Move norm weights and ``layer_scalar`` off their initial ones (so that their
    loading is tested) and scale layers 1..'s residual contributions by ``layer_gain``:
    with tied embeddings the scaled token embedding dominates a random Gemma4's residual
    stream and it repeats its input; amplified layers give varied output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("scale", "layer_scalar")):
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
        # Gemma4 norms each sublayer's output, so its scale is the post-norm weight.
        for layer in model.model.layers[1:]:
            layer.post_attention_layernorm.weight.mul_(layer_gain)
            layer.post_feedforward_layernorm.weight.mul_(layer_gain)


def tiny_gemma4(
    vocab_size: int, eos_token_id: int, seed: int, layer_gain: float = 2.0, **overrides
):
    """A tiny random ``transformers`` ``Gemma4ForCausalLM`` (eval mode)."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(gemma4_text_config(vocab_size, eos_token_id, **overrides)).eval()
    perturb_scales(model, seed, layer_gain)
    return model


@contextlib.contextmanager
def assistant_kv_sharing_fix() -> Iterator[None]:
    """``transformers`` 5.23's ``Gemma4TextConfig.kv_sharing_modes`` raises when every
    layer is KV-shared, which a ``gemma4_assistant``'s text config always is, so its
    model cannot be built. Inside this context an all-shared config reports every layer
    as ``reuse``, which is what the assistant's layers do. Versions without the property
    (5.17) build the model as is."""
    from transformers import Gemma4TextConfig

    original = getattr(Gemma4TextConfig, "kv_sharing_modes", None)
    if original is None:
        yield
        return

    def modes(self):
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return original.fget(self)

    Gemma4TextConfig.kv_sharing_modes = property(modes)
    try:
        yield
    finally:
        Gemma4TextConfig.kv_sharing_modes = original


def save(model, tokenizer, path: Path) -> Path:
    """Save ``model`` (float32 safetensors) and ``tokenizer`` into ``path``."""
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def tiny_gemma4_assistant(target, seed: int, damp: float = 0.05, **overrides):
    """A ``transformers`` ``Gemma4AssistantForCausalLM`` for ``target``: 2 layers (one of
    each type, shaped to read the target's KV), hidden size equal to the target's.

    Its weights are wired to agree with the target often: ``pre_projection`` passes the
    target's token embedding through (and the backbone state faintly), its sliding layer
    is a copy of the target's layer 0 (but reads the target's layer-3 KV), its full
    layer is random and damped by ``damp``, and its LM head and final norm are the
    target's: it drafts roughly what the target would predict from the token alone.
    """
    from transformers.models.gemma4_assistant import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
    )

    tc = target.config
    sliding, full = tc.per_layer_config["sliding_attention"], tc.per_layer_config["full_attention"]
    text = dict(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
        num_attention_heads=tc.num_attention_heads, num_key_value_heads=sliding.num_key_value_heads,
        head_dim=sliding.head_dim, global_head_dim=full.head_dim,
        num_global_key_value_heads=full.num_key_value_heads,
        attention_k_eq_v=tc.attention_k_eq_v, sliding_window=tc.sliding_window,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        max_position_embeddings=tc.max_position_embeddings, initializer_range=0.2,
    )
    fields = dict(text_config=text, backbone_hidden_size=tc.hidden_size)
    fields.update(overrides)
    torch.manual_seed(seed)
    with assistant_kv_sharing_fix():
        assistant = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(**fields)).eval()
    hidden = tc.hidden_size
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        eye = torch.eye(hidden)
        assistant.pre_projection.weight.copy_(
            torch.cat([eye, 0.1 * torch.randn(hidden, hidden, generator=gen)], dim=1)
        )
        assistant.post_projection.weight.copy_(eye)
        assistant.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        assistant.model.norm.weight.copy_(target.model.norm.weight)
        source = target.model.layers[0].state_dict()
        mimic = assistant.model.layers[0]
        mimic.load_state_dict({k: v for k, v in source.items() if k in mimic.state_dict()})
        full = assistant.model.layers[1]
        full.post_attention_layernorm.weight.mul_(damp)
        full.post_feedforward_layernorm.weight.mul_(damp)
        if assistant.masked_embedding is not None:
            assistant.masked_embedding.token_ordering.copy_(
                torch.randperm(tc.vocab_size, generator=gen)
            )
    return assistant


def load_hf_assistant(path: Path):
    """``Gemma4AssistantForCausalLM.from_pretrained`` (float32, eval)."""
    from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

    with assistant_kv_sharing_fix():
        return Gemma4AssistantForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
