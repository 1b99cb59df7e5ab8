"""The ``eagle3`` method (Li et al., arXiv 2503.01840)."""

from __future__ import annotations

import torch

from specula.runtime.kernels.gemv import linear_argmax
from specula.runtime.models.llama_eagle3 import Eagle3LlamaForCausalLM, load_eagle3_draft
from specula.runtime.models.speculators_format import share_target_weights
from specula.runtime.spec_decode.autoregressive import AutoRegressiveSpeculator
from specula.runtime.spec_decode.draft_model_base import DraftRunner
from specula.runtime.worker.paged_kv import PagedAttentionMetadata


class Eagle3Runner(DraftRunner):
    """Runs an :class:`Eagle3LlamaForCausalLM` over a paged KV cache of its layers
    (raises as :class:`DraftRunner`)."""

    @torch.no_grad()
    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: PagedAttentionMetadata,
        hidden_states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward of ``input_ids`` ([num_tokens] int64, the token after each conditioning
        position) at ``positions`` with ``hidden_states [num_tokens, H]`` (fused target states or
        the draft's previous output), writing its KV (AssertionError: other shapes).

        Returns:
            ``(normed [num_tokens, H] for the logits, [num_tokens, H] the next state)``.
        """
        assert input_ids.ndim == 1 and input_ids.shape == positions.shape
        assert input_ids.shape[0] == metadata.num_tokens
        assert hidden_states.shape == (input_ids.shape[0], self.config.hidden_size)
        model, first = self.model, self.model.layers[0]  # layer 0 attends over [embedding, hidden]
        hidden, normed_hidden = self.normed_pair(input_ids, hidden_states, first.input_layernorm,
                                                 first.hidden_norm)
        residual = normed_hidden if first.norm_before_residual else hidden_states
        normed, residual = self.decoder(model.layers, hidden, residual, positions, metadata, model.norm)
        return normed, normed if model.eagle.norm_output else residual


class EagleSpeculator(AutoRegressiveSpeculator):
    """EAGLE-3 over the generic loop: ``fc`` fuses the target's residual streams entering
    the checkpoint's ``eagle_aux_hidden_state_layer_ids`` (default ``(2, L // 2, L -
    3)``); drafts come from the draft vocabulary mapped through ``d2t``.

    Raises (at construction):
        ValueError: the checkpoint does not fit the target (see
            :func:`~specula.runtime.models.llama_eagle3.load_eagle3_draft`).
    """

    conditions_on_hidden_states = True
    model_returns_tuple = True
    model: Eagle3LlamaForCausalLM

    def load_draft_model(self) -> Eagle3LlamaForCausalLM:
        model = load_eagle3_draft(self.draft_dir, self.target_config, self.dtype, self.device,
                                  self.load_format)
        self.aux_hidden_state_layers = model.eagle.aux_hidden_state_layer_ids
        return model

    def bind_target(self, target_runner) -> None:
        embed, lm_head = target_runner.model.full_vocab_weights()  # whole, at any TP degree
        share_target_weights(self.model, embed, lm_head, self.model.draft_to_target)

    def build_runner(self, kv_cache, max_model_len: int) -> Eagle3Runner:
        return Eagle3Runner(self.model, kv_cache, max_model_len)

    def conditioning(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        assert aux is not None, "EAGLE-3 reads the target's auxiliary hidden states"
        return self.model.combine_hidden_states(aux)

    def draft_argmax(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        ids = linear_argmax(hidden, self.model.lm_head.weight)[1]
        return torch.index_select(self.model.draft_to_target, 0, ids, out=out)
