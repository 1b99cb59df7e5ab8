"""The ``mtp`` method (DeepSeek-style multi-token prediction, arXiv 2412.19437; vLLM's ``mtp``)."""

from __future__ import annotations

import torch

from specula.runtime.kernels.gemv import gemv, linear, linear_argmax, use_gemv
from specula.runtime.models.mtp import MTPForCausalLM, load_mtp_draft
from specula.runtime.models.speculators_format import share_target_weights
from specula.runtime.spec_decode.autoregressive import AutoRegressiveSpeculator
from specula.runtime.spec_decode.draft_model_base import DraftRunner
from specula.runtime.worker.model_runner import fold_norms
from specula.runtime.worker.paged_kv import PagedAttentionMetadata


class MTPRunner(DraftRunner):
    """Runs an :class:`MTPForCausalLM` over a paged KV cache of its layer, its block's norms
    folded where the GEMV runs them (:func:`fold_norms`; raises as :class:`DraftRunner`)."""

    weight_name = "mtp_layers.0.eh_proj.weight"

    def __init__(self, model: MTPForCausalLM, kv_cache, max_model_len: int) -> None:
        super().__init__(model, kv_cache, max_model_len)
        self.norms_folded = fold_norms(model, [model.mtp_layers[0].block])

    @torch.no_grad()
    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: PagedAttentionMetadata,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        """``input_ids`` [num_tokens] int64 (the token after each conditioning position)
        and ``hidden_states [num_tokens, H]`` (the target's final states or this head's
        previous output) -> [num_tokens, H] normed states, for the logits and next step."""
        assert hidden_states.shape == (input_ids.shape[0], self.config.hidden_size)
        layer = self.model.mtp_layers[0]
        x = self.normed_pair(input_ids, hidden_states, layer.enorm, layer.hnorm)[0]
        if self.norms_folded and use_gemv(x, layer.eh_proj.weight):  # input norm in qkv_proj's GEMV
            x, sum_sq = gemv(x, layer.eh_proj.weight, sums_of_squares=True)
        else:
            x, sum_sq = linear(x, layer.eh_proj.weight), None
        return self.decoder([layer.block], x, None, positions, metadata, layer.final_layernorm,
                            sum_sq=sum_sq)[0]


class MTPSpeculator(AutoRegressiveSpeculator):
    """DeepSeek-V3 MTP (arXiv 2412.19437, §2.2) over the generic loop, conditioned on the
    target's final normed hidden states (as vLLM's MTP proposer); every draft step reuses
    the one MTP layer on its own previous output, as ``speculators`` trains it.

    Raises (at construction):
        ValueError: the checkpoint does not fit the target (see
            :func:`~specula.runtime.models.mtp.load_mtp_draft`).
    """

    conditions_on_hidden_states = True
    model: MTPForCausalLM

    def load_draft_model(self) -> MTPForCausalLM:
        return load_mtp_draft(self.draft_dir, self.target_config, self.dtype, self.device, self.load_format)

    def bind_target(self, target_runner) -> None:
        share_target_weights(self.model, *target_runner.model.full_vocab_weights())

    def build_runner(self, kv_cache, max_model_len: int) -> MTPRunner:
        return MTPRunner(self.model, kv_cache, max_model_len)

    def draft_argmax(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return linear_argmax(hidden, self.model.lm_head.weight, out)[1]  # the argmax epilogue
