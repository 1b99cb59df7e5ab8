"""The EAGLE-3 draft head's forward on the GPU kernels, over its own paged KV cache.

The head (:class:`~specula.runtime.models.llama_eagle3.Eagle3LlamaForCausalLM`, Li et
al., arXiv 2503.01840) owns its weights; this runner applies them with the same kernels
and sublayers as the target's :class:`~specula.runtime.worker.model_runner.ModelRunner`,
on the target's block tables (:class:`~specula.runtime.spec_decode.draft_model_base.
DraftRunner`).
"""

from __future__ import annotations

import torch

from specula.runtime.kernels.layernorm import rms_norm
from specula.runtime.models.llama_eagle3 import Eagle3LlamaForCausalLM
from specula.runtime.spec_decode.draft_model_base import DraftRunner
from specula.runtime.worker.paged_kv import PagedAttentionMetadata, PagedKVCache


class Eagle3Runner(DraftRunner):
    """Runs an :class:`Eagle3LlamaForCausalLM` (the target's weights bound:
    ``missing_target_weights`` empty) over a :class:`PagedKVCache` of its layers with the
    Triton kernels.

    Raises:
        ValueError: unbound target weights, or a cache that does not match the head.
    """

    def __init__(
        self, model: Eagle3LlamaForCausalLM, kv_cache: PagedKVCache, max_model_len: int
    ) -> None:
        super().__init__(model, kv_cache, max_model_len, len(model.layers), model.fc.weight)

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
        ln = first.input_layernorm  # layer 0 attends over [embedding, hidden], width 2H
        hidden = torch.cat([rms_norm(embeds, ln.weight, ln.eps), normed_hidden], dim=-1)
        normed, residual = self.decoder(
            model.layers, hidden, residual, positions, metadata, model.norm
        )
        return normed, normed if model.eagle.norm_output else residual
