"""The ``mtp`` method: an MTP layer conditioned on the target's final hidden state
drafts autoregressively with the target's embeddings and LM head."""

from __future__ import annotations

import torch

from specula.runtime.kernels.gemv import linear_argmax
from specula.runtime.models.mtp import MTPForCausalLM, load_mtp_draft, share_target_weights
from specula.runtime.spec_decode.autoregressive import AutoRegressiveSpeculator
from specula.runtime.spec_decode.mtp.runner import MTPRunner


class MTPSpeculator(AutoRegressiveSpeculator):
    """DeepSeek-V3 MTP (arXiv 2412.19437, §2.2) over the generic loop. Conditioning rows
    are the target's final normed hidden states (what vLLM's MTP proposer feeds); every
    draft step reuses the checkpoint's one MTP layer, reading its own previous output, so
    any k works (as ``speculators`` trains it: the same layer for every step). Logits
    cover the full vocabulary through the target's LM head.

    Raises (at construction):
        ValueError: the checkpoint does not fit the target (see
            :func:`~specula.runtime.models.mtp.load_mtp_draft`).
    """

    conditions_on_hidden_states = True
    model: MTPForCausalLM

    def load_draft_model(self) -> MTPForCausalLM:
        return load_mtp_draft(
            self.draft_dir, self.target_config, self.dtype, self.device, self.load_format
        )

    def bind_target(self, target_runner) -> None:
        target = target_runner.model
        share_target_weights(self.model, target.model.embed_tokens, target.lm_head_weight)

    def draft_kv_layers(self) -> int:
        return len(self.model.mtp_layers)

    def build_runner(self, kv_cache, max_model_len: int) -> MTPRunner:
        return MTPRunner(self.model, kv_cache, max_model_len)

    def draft_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear_argmax(hidden, self.model.lm_head.weight)[1]  # the argmax epilogue
