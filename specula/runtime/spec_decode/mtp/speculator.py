"""The ``mtp`` method: an MTP layer conditioned on the target's final hidden state
drafts autoregressively with the target's embeddings and LM head."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specula.runtime.models.mtp import MTPForCausalLM, load_mtp_draft, share_target_weights
from specula.runtime.spec_decode.autoregressive import AutoRegressiveSpeculator

if TYPE_CHECKING:
    from specula.runtime.engine.model_runner import ModelRunner


class MTPSpeculator(AutoRegressiveSpeculator):
    """MTP over the generic loop. Conditioning rows are the target's final normed
    hidden states (what vLLM's MTP proposer feeds); every draft step reuses the
    checkpoint's one MTP layer, reading its own previous output, so any k works (as
    ``speculators`` trains it: the same layer for every step).

    Raises (at construction):
        ValueError: the checkpoint does not fit the target (see
            :func:`~specula.runtime.models.mtp.load_mtp_draft`).
    """

    uses_target_hidden_states = True
    conditions_on_hidden_states = True
    model: MTPForCausalLM

    def load_draft_model(self) -> MTPForCausalLM:
        return load_mtp_draft(self.draft_dir, self.target_config, self.dtype, self.device)

    def bind_target(self, target_runner: ModelRunner) -> None:
        target = target_runner.model
        share_target_weights(self.model, target.model.embed_tokens, target.lm_head_weight)
