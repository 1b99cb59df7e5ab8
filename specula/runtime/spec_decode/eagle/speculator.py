"""The ``eagle3`` method: a one-layer head conditioned on the target's auxiliary
hidden states drafts autoregressively, feeding back its own hidden state."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specula.runtime.models.llama_eagle3 import (
    Eagle3LlamaForCausalLM,
    load_eagle3_draft,
    share_target_weights,
)
from specula.runtime.spec_decode.autoregressive import AutoRegressiveSpeculator
from specula.runtime.spec_decode.base import TargetHiddenStates

if TYPE_CHECKING:
    from specula.runtime.engine.model_runner import ModelRunner


class Eagle3Speculator(AutoRegressiveSpeculator):
    """EAGLE-3 over the generic loop: the target records the residual stream entering
    the checkpoint's ``eagle_aux_hidden_state_layer_ids`` (default ``(2, L // 2,
    L - 3)``); ``fc`` fuses them on arrival; the head's forward returns ``(normed,
    next-step state)``; logits cover the target vocabulary (``-inf`` outside the
    draft vocabulary's ``d2t`` image), so sampled drafts stay exact under rejection
    sampling.

    Raises (at construction):
        ValueError: the checkpoint does not fit the target (see
            :func:`~specula.runtime.models.llama_eagle3.load_eagle3_draft`).
    """

    uses_target_hidden_states = True
    conditions_on_hidden_states = True
    model_returns_tuple = True
    model: Eagle3LlamaForCausalLM

    def load_draft_model(self) -> Eagle3LlamaForCausalLM:
        model = load_eagle3_draft(self.draft_dir, self.target_config, self.dtype, self.device)
        self.aux_hidden_state_layers = model.eagle.aux_hidden_state_layer_ids
        return model

    def bind_target(self, target_runner: ModelRunner) -> None:
        target = target_runner.model
        share_target_weights(self.model, target.model.embed_tokens, target.lm_head_weight)

    def conditioning_from_target(self, states: TargetHiddenStates) -> torch.Tensor:
        assert states.aux_hidden_states is not None
        return self.model.combine_hidden_states(states.aux_hidden_states)
