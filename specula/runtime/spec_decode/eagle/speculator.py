"""The ``eagle3`` method: a small head conditioned on the target's auxiliary hidden
states drafts autoregressively, feeding back its own hidden state."""

from __future__ import annotations

import torch

from specula.runtime.kernels.gemv import linear_argmax
from specula.runtime.models.llama_eagle3 import Eagle3LlamaForCausalLM, load_eagle3_draft
from specula.runtime.models.speculators_format import share_target_weights
from specula.runtime.spec_decode.autoregressive import AutoRegressiveSpeculator
from specula.runtime.spec_decode.eagle.runner import Eagle3Runner


class EagleSpeculator(AutoRegressiveSpeculator):
    """EAGLE-3 (Li et al., arXiv 2503.01840) over the generic loop: the target records
    the residual streams entering the checkpoint's ``eagle_aux_hidden_state_layer_ids``
    (default ``(2, L // 2, L - 3)``), ``fc`` fuses them, the head returns ``(normed,
    next-step state)``, and drafts come from the draft vocabulary mapped through
    ``d2t`` (``-inf`` elsewhere when drafts are sampled).

    Raises (at construction):
        ValueError: the checkpoint does not fit the target (see
            :func:`~specula.runtime.models.llama_eagle3.load_eagle3_draft`).
    """

    conditions_on_hidden_states = True
    model_returns_tuple = True
    model: Eagle3LlamaForCausalLM

    def load_draft_model(self) -> Eagle3LlamaForCausalLM:
        model = load_eagle3_draft(
            self.draft_dir, self.target_config, self.dtype, self.device, self.load_format
        )
        self.aux_hidden_state_layers = model.eagle.aux_hidden_state_layer_ids
        return model

    def bind_target(self, target_runner) -> None:
        target = target_runner.model
        embed, lm_head = target.model.embed_tokens, target.lm_head_weight
        share_target_weights(self.model, embed, lm_head, self.model.draft_to_target)

    def build_runner(self, kv_cache, max_model_len: int) -> Eagle3Runner:
        return Eagle3Runner(self.model, kv_cache, max_model_len)

    def conditioning(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        assert aux is not None, "EAGLE-3 reads the target's auxiliary hidden states"
        return self.model.combine_hidden_states(aux)

    def draft_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Argmax over the draft vocabulary, mapped to target ids through ``d2t``."""
        # The LM head with its argmax fused in ([n, draft_vocab_size] logits unused).
        return self.model.draft_to_target[linear_argmax(hidden, self.model.lm_head.weight)[1]]
