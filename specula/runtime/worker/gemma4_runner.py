"""The paged forward of a Gemma4 text target on the GPU kernels.

:class:`~specula.runtime.models.gemma4.Gemma4ForCausalLM` owns the weights; this module
runs them over a :class:`~specula.runtime.worker.paged_kv.PagedKVCache` as a
:class:`~specula.runtime.worker.model_runner.ModelRunner` with Gemma4's layers.

What differs from the Llama path (see :mod:`specula.runtime.models.gemma4` for the model):

- sliding-window layers attend to the last ``sliding_window`` positions only: the paged
  kernel's window (decode, verification), a banded causal mask for prefills;
- per layer type its own head size, KV heads and rotary table (``proportional`` RoPE is
  a table whose unrotated pairs have frequency 0, so the fused rotary + cache-write
  kernel applies it as a full-width rotation);
- queries, keys and values are RMS-normed per head before rotary (values unscaled), softmax scale 1;
- KV-shared layers (``num_kv_shared_layers``) own no cache: they rotate their queries
  only and attend to the cache of the last earlier non-shared layer of their type; a
  prefill reuses that layer's keys and values of the same forward;
- sandwich norms around attention and MLP, per-layer input embeddings (PLE), the learned
  ``layer_scalar``, final logit soft-capping.

Gemma4's norms scale by ``weight`` directly (not Gemma 1-3's ``1 + weight``), so they
run on the plain (Llama-convention) RMSNorm kernel: exact in float32; in bfloat16 the
kernel rounds the normalised row once more before the weight multiplies it, where
:class:`~specula.runtime.models.gemma4_layers.Gemma4RMSNorm` multiplies in float32.

A decode or verification forward copies nothing to the host, so
:class:`~specula.runtime.worker.cudagraph.CUDAGraphManager` captures it. The
mixture-of-experts variant (26B-A4B) is refused: its expert dispatch runs on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specula.runtime.kernels.activation import silu_and_mul
from specula.runtime.kernels.layernorm import fused_add_rms_norm, rms_norm
from specula.runtime.kernels.rotary import (
    build_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_and_cache,
)
from specula.runtime.models.gemma4 import Gemma4Attention, Gemma4DecoderLayer, Gemma4ForCausalLM
from specula.runtime.models.gemma4_config import SLIDING, Gemma4ModelConfig
from specula.runtime.models.gemma4_layers import Gemma4RMSNorm
from specula.runtime.models.layers import RotaryEmbedding
from specula.runtime.models.registry import check_servable
from specula.runtime.worker.model_runner import ModelRunner, attend
from specula.runtime.worker.paged_kv import PagedAttentionMetadata, PagedKVCache


def _norm(x: torch.Tensor, norm: Gemma4RMSNorm) -> torch.Tensor:
    return rms_norm(x, norm.weight, norm.eps)


class Gemma4PagedLayers(ModelRunner):
    """Gemma4 decoder layers on the kernels over a paged KV cache: the part of the
    forward that the target (:class:`Gemma4Runner`) and its MTP draft
    (:class:`~specula.runtime.spec_decode.gemma4.runner.Gemma4AssistantRunner`) share.

    Args:
        config: the layers' config (the target's, or the assistant's text config).
        kv_cache: the target's cache; entry ``kv_sources[i]`` is what layer ``i`` reads.
        kv_sources: per layer, its cache entry (written by the layer unless it is KV-shared).
        windows: per layer, its sliding window in keys (own position included) or ``None``.
        rotary: per layer type, the rotary embedding (``inv_freq``) of that type.
        max_model_len, attn_num_splits: as for :class:`ModelRunner`.
        weight: one of the layers' parameters (their device and dtype).

    Raises:
        ValueError: a cache in another dtype.
    """

    def __init__(self, config: Gemma4ModelConfig, kv_cache: PagedKVCache, kv_sources: Sequence[int],
                 windows: Sequence[int | None], rotary: dict[str, RotaryEmbedding],
                 max_model_len: int, attn_num_splits: int | None, weight: torch.Tensor) -> None:
        self.setup_cache(config, kv_cache, max_model_len, attn_num_splits, weight)
        device, dtype = weight.device, weight.dtype
        self.kv_sources, self.windows = tuple(kv_sources), tuple(windows)
        self.cos_sin_caches = {t: build_cos_sin_cache(r.inv_freq.to(device), max_model_len)
                               for t, r in rotary.items()}
        # The value norm has no scale: a weight of ones makes the plain RMSNorm kernel
        # compute exactly x * rsqrt(mean(x^2) + eps).
        self._unit_weights = {d: torch.ones(d, dtype=dtype, device=device)
                              for d in set(config.layer_head_dims)}

    def _head_norm(self, x: torch.Tensor, norm: Gemma4RMSNorm, num_heads: int) -> torch.Tensor:
        # x: [num_tokens, num_heads * head_dim] -> [num_tokens, num_heads, head_dim]
        head_dim = x.shape[1] // num_heads
        weight = self._unit_weights[head_dim] if norm.weight is None else norm.weight
        return rms_norm(x.reshape(-1, head_dim), weight, norm.eps).view(-1, num_heads, head_dim)

    def _attention(self, attn: Gemma4Attention, hidden: torch.Tensor, positions: torch.Tensor,
                   layer_idx: int, metadata: PagedAttentionMetadata,
                   produced: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        # hidden: [num_tokens, hidden_size]
        cos_sin = self.cos_sin_caches[self.config.layer_types[layer_idx]]
        source = self.kv_sources[layer_idx]
        key_cache, value_cache = self.kv_cache.layer(source)
        q = self._head_norm(attn.q_proj(hidden), attn.q_norm, attn.num_heads)
        if attn.kv_shared:
            rotary_embedding(positions, q, None, cos_sin)
            # The producer's keys and values of this forward, which prefill rows attend over;
            # decode, verification and draft rows (their producer ran earlier) read the cache only.
            k, v = produced.get(source, (None, None))
        else:
            k_proj = attn.k_proj(hidden)  # [num_tokens, num_kv_heads * head_dim]
            v_proj = k_proj if attn.v_proj is None else attn.v_proj(hidden)
            k = self._head_norm(k_proj, attn.k_norm, attn.num_kv_heads)
            v = self._head_norm(v_proj, attn.v_norm, attn.num_kv_heads)
            rotary_embedding_and_cache(positions, q, k, v, key_cache, value_cache,
                                       metadata.slot_mapping, cos_sin)
            produced[layer_idx] = (k, v)
        # q, k and v are normed: the softmax scale is 1.
        out = attend(q, k, v, key_cache, value_cache, metadata, 1.0, self.attn_num_splits,
                     self.windows[layer_idx])
        # flatten (a reshape, not a view): a one-request prefill's SDPA output may keep a
        # [heads, tokens] layout (backends without a fused kernel for this head size).
        return attn.o_proj(out.flatten(1))

    def _layer(self, layer: Gemma4DecoderLayer, hidden: torch.Tensor,
               per_layer_input: torch.Tensor | None, positions: torch.Tensor, layer_idx: int,
               metadata: PagedAttentionMetadata,
               produced: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One decoder layer, as :meth:`Gemma4DecoderLayer.forward`.

        Args:
            hidden: [num_tokens, hidden_size] residual stream.
            per_layer_input: [num_tokens, hidden_size_per_layer_input] or ``None``.
            positions: [num_tokens] int64 rotary positions.
            produced: this forward's keys and values by cache entry, filled by
                non-shared layers and read by the shared layers of a prefill.

        Returns:
            [num_tokens, hidden_size].
        """
        x = _norm(hidden, layer.input_layernorm)
        x = self._attention(layer.self_attn, x, positions, layer_idx, metadata, produced)
        x = _norm(x, layer.post_attention_layernorm)
        # hidden + post_norm(attn), then the pre-MLP norm of that sum, in one pass.
        ln = layer.pre_feedforward_layernorm
        x, hidden = fused_add_rms_norm(x, hidden, ln.weight, ln.eps)
        x = (layer.mlp.down_proj(silu_and_mul(layer.mlp.gate_up_proj(x)))
             if self.config.hidden_act == "silu" else layer.mlp(x))
        hidden = hidden + _norm(x, layer.post_feedforward_layernorm)
        if per_layer_input is not None:
            gate = layer.act(layer.per_layer_input_gate(hidden)) * per_layer_input
            projected = layer.per_layer_projection(gate)
            hidden = hidden + _norm(projected, layer.post_per_layer_input_norm)
        return hidden * layer.layer_scalar


class Gemma4Runner(Gemma4PagedLayers):
    """Runs a :class:`Gemma4ForCausalLM` over a :class:`PagedKVCache` with the
    Triton kernels, as :class:`ModelRunner` runs Llama and Qwen3.

    Args:
        model: the target, on its device, in eval mode, in the cache's dtype.
        kv_cache: one key/value pair per non-shared layer, shaped as
            ``model.config.kv_cache_shapes()`` (:meth:`KVCacheSpec.from_model_config`);
            KV-shared layers read their producer's pair.
        max_model_len, attn_num_splits: as for :class:`ModelRunner`.

    Raises:
        ValueError: not a Gemma4 text model, the mixture-of-experts variant, or a mismatched cache.
    """

    def __init__(self, model: Gemma4ForCausalLM, kv_cache: PagedKVCache, max_model_len: int,
                 attn_num_splits: int | None = None) -> None:
        if not isinstance(model, Gemma4ForCausalLM):
            raise ValueError(f"{type(model).__name__} is not a Gemma4ForCausalLM")
        config = model.config
        check_servable(config)
        spec = kv_cache.spec
        if spec.layer_shapes != tuple(config.kv_cache_shapes()):
            raise ValueError(f"KV cache {spec} does not match the model's per-layer KV shapes "
                             f"{config.kv_cache_shapes()}")
        super().__init__(
            config, kv_cache, config.kv_source_layers(),
            [config.sliding_window if t == SLIDING else None for t in config.layer_types],
            model.rotary.by_type, max_model_len, attn_num_splits, model.model.embed_tokens.weight)
        self.model = model

    def _run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    metadata: PagedAttentionMetadata, aux_layer_ids: Sequence[int],
                    captured: dict[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.model.model
        hidden = model.embed(input_ids)  # [num_tokens, hidden_size]
        per_layer = (model.per_layer_inputs(input_ids, hidden)  # [n, layers, ple]
                     if self.config.hidden_size_per_layer_input else None)
        produced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(model.layers):
            if i in aux_layer_ids:
                captured[i] = hidden
            per_layer_input = None if per_layer is None else per_layer[:, i]
            hidden = self._layer(layer, hidden, per_layer_input, positions, i, metadata, produced)
        return _norm(hidden, model.norm), hidden

    def logits_and_argmax(self, hidden: torch.Tensor, need_logits: bool = True,
                          into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(compute_logits(hidden), its argmax [num_positions] int64)``: float32 logits,
        soft-capped as :meth:`Gemma4ForCausalLM.compute_logits`, whatever ``need_logits``;
        ``into`` as :meth:`ModelRunner.logits_and_argmax` takes it."""
        logits = self.compute_logits(hidden)
        return logits, logits.argmax(dim=-1) if into is None else torch.argmax(logits, -1, out=into)
