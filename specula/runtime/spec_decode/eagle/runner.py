"""The EAGLE-3 draft head's forward on the GPU kernels, over its own paged KV cache.

The head (:class:`~specula.runtime.models.llama_eagle3.Eagle3LlamaForCausalLM`, Li et
al., arXiv 2503.01840) owns its weights; this runner applies them with the same kernels
and sublayers as the target's :class:`~specula.runtime.worker.model_runner.ModelRunner`.
The draft's cache has as many blocks as the target's and is indexed by the *target's*
block tables and slot mappings (one block manager for both, as vLLM allocates draft
layers in the target's KV-cache groups): a draft forward over the slots of a
verification forward can then read that forward's attention metadata unchanged, which is
what attention-state reuse (vLLM PR #40410) relies on.
"""

from __future__ import annotations

import torch

from specula.runtime.kernels.layernorm import fused_add_rms_norm, rms_norm
from specula.runtime.models.llama_eagle3 import Eagle3LlamaForCausalLM
from specula.runtime.worker.model_runner import ModelRunner
from specula.runtime.worker.paged_kv import PagedAttentionMetadata, PagedKVCache


class Eagle3Runner(ModelRunner):
    """Runs an :class:`Eagle3LlamaForCausalLM` over a :class:`PagedKVCache` of its
    layers with the Triton kernels.

    Args:
        model: the head on its device, in eval mode, in the cache's dtype, with the
            target's weights bound (``missing_target_weights`` empty).
        kv_cache: one key/value pair per draft layer; ``num_blocks`` and ``block_size``
            equal to the target cache's (block tables are shared).
        max_model_len: as for the target runner.
        attn_num_splits: as for the target runner.

    Raises:
        ValueError: unbound target weights, or a cache that does not match the head.
    """

    def __init__(
        self,
        model: Eagle3LlamaForCausalLM,
        kv_cache: PagedKVCache,
        max_model_len: int,
        attn_num_splits: int | None = None,
    ) -> None:
        if model.missing_target_weights:
            raise ValueError(f"bind the target's {sorted(model.missing_target_weights)} first")
        self.model = model
        self.setup_paged(
            model.config, kv_cache, len(model.layers), model.rotary.inv_freq, model.fc.weight,
            max_model_len, attn_num_splits,
        )

    @torch.no_grad()
    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: PagedAttentionMetadata,
        hidden_states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward, writing the draft's keys and values to its cache.

        Args:
            input_ids: [num_tokens] int64, the token after each conditioning position.
            positions: [num_tokens] int64 rotary positions.
            metadata: paged metadata over the shared block tables.
            hidden_states: [num_tokens, H], fused target states or the draft's previous
                output.

        Returns:
            ``(normed [num_tokens, H] for the draft logits, [num_tokens, H] the state the
            next draft step reads)``, as
            :meth:`Eagle3LlamaForCausalLM.forward`.

        Raises:
            AssertionError: shapes that do not match the above.
        """
        assert input_ids.ndim == 1 and input_ids.shape == positions.shape
        assert input_ids.shape[0] == metadata.num_tokens
        assert hidden_states.shape == (input_ids.shape[0], self.config.hidden_size)
        model = self.model
        first = model.layers[0]
        embeds = model.embed_tokens(input_ids)  # [num_tokens, H]
        normed_hidden = rms_norm(hidden_states, first.hidden_norm.weight, first.hidden_norm.eps)
        residual = normed_hidden if first.norm_before_residual else hidden_states
        for i, layer in enumerate(model.layers):
            ln = layer.input_layernorm
            if i == 0:  # attention over [embedding, hidden], width 2H
                hidden = torch.cat([rms_norm(embeds, ln.weight, ln.eps), normed_hidden], dim=-1)
            else:
                hidden, residual = fused_add_rms_norm(hidden, residual, ln.weight, ln.eps)
            hidden = self._attention(layer.self_attn, hidden, positions, i, metadata)
            ln = layer.post_attention_layernorm
            hidden, residual = fused_add_rms_norm(hidden, residual, ln.weight, ln.eps)
            hidden = self._mlp(layer.mlp, hidden)
        normed, residual = fused_add_rms_norm(hidden, residual, model.norm.weight, model.norm.eps)
        return normed, normed if model.eagle.norm_output else residual
