"""The MTP head's forward on the kernels over its own paged KV cache (one attention
layer), with the target's block tables."""

from __future__ import annotations

import torch

from specula.runtime.kernels.layernorm import fused_add_rms_norm, rms_norm
from specula.runtime.models.mtp import MTPForCausalLM
from specula.runtime.worker.model_runner import ModelRunner
from specula.runtime.worker.paged_kv import PagedAttentionMetadata, PagedKVCache


class MTPRunner(ModelRunner):
    """Runs an :class:`MTPForCausalLM` (DeepSeek-V3 MTP, arXiv 2412.19437) with the
    sublayers of :class:`ModelRunner`.

    Raises:
        ValueError: unbound target weights, or a cache that does not match the layer.
    """

    def __init__(self, model: MTPForCausalLM, kv_cache: PagedKVCache, max_model_len: int) -> None:
        if model.missing_target_weights:
            raise ValueError(f"bind the target's {sorted(model.missing_target_weights)} first")
        self.model = model
        layer = model.mtp_layers[0]
        self.setup_paged(
            model.config, kv_cache, 1, model.rotary.inv_freq, layer.eh_proj.weight,
            max_model_len, None,
        )

    @torch.no_grad()
    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: PagedAttentionMetadata,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        """``eh_proj(cat(enorm(embed(input_ids)), hnorm(hidden_states)))`` through the
        decoder block and the final norm.

        Args:
            input_ids: [num_tokens] int64, the token after each conditioning position.
            positions: [num_tokens] int64.
            metadata: paged metadata over the shared block tables.
            hidden_states: [num_tokens, H] the target's final states or this head's
                previous output.

        Returns:
            [num_tokens, H] normed states, for the logits and the next step.
        """
        assert hidden_states.shape == (input_ids.shape[0], self.config.hidden_size)
        layer = self.model.mtp_layers[0]
        block = layer.block
        embeds = self.model.embed_tokens(input_ids)  # [num_tokens, H]
        x = layer.eh_proj(
            torch.cat(
                [
                    rms_norm(embeds, layer.enorm.weight, layer.enorm.eps),
                    rms_norm(hidden_states.to(embeds.dtype), layer.hnorm.weight, layer.hnorm.eps),
                ],
                dim=-1,
            )
        )
        ln = block.input_layernorm
        hidden = self._attention(
            block.self_attn, rms_norm(x, ln.weight, ln.eps), positions, 0, metadata
        )
        ln = block.post_attention_layernorm
        hidden, residual = fused_add_rms_norm(hidden, x, ln.weight, ln.eps)
        hidden = self._mlp(block.mlp, hidden)
        norm = layer.final_layernorm
        return fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)[0]
