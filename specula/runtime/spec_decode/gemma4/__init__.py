"""Gemma4 multi-token prediction (the ``gemma4_mtp`` method): a ``gemma4_assistant`` checkpoint
drafts for a Gemma4 target by reading the target's KV cache. With verified tokens ``t_0 .. t_{n-1}``
(``t_{n-1}`` just sampled, its KV not yet cached), every draft step runs one row per request at the
constant rotary position ``n - 1``, attending to the target's cached positions ``0 .. n - 2``. Step
1 reads ``t_{n-1}`` with the target's final hidden state at ``n - 2``; step ``s`` reads draft token
``s - 1`` with the assistant's own ``post_projection`` output. This is what ``transformers``'
``SinglePositionMultiTokenCandidateGenerator`` does for ``generate(..., assistant_model=...)``,
except that rows here never see the target's KV of rejected drafts (there they may, after a
partially rejected round): the output is the target's either way, only acceptance can differ.
"""

from __future__ import annotations

import torch

from specula.runtime.models.gemma4_assistant import (
    Gemma4AssistantForCausalLM,
    check_gemma4_target,
    load_gemma4_assistant,
)
from specula.runtime.spec_decode.autoregressive import AutoRegressiveSpeculator
from specula.runtime.spec_decode.gemma4.runner import Gemma4AssistantRunner


class Gemma4MTPSpeculator(AutoRegressiveSpeculator):
    """Gemma4 MTP over the generic loop.

    Raises (at construction):
        ValueError: not a ``gemma4_assistant`` checkpoint, or one that does not fit the
            target (a non-Gemma4 target, a different backbone hidden size, vocabulary,
            head size or layer type); the message names the field and both values.
    """

    reads_target_kv = True
    model_returns_tuple = True
    model: Gemma4AssistantForCausalLM

    def load_draft_model(self) -> Gemma4AssistantForCausalLM:
        model = load_gemma4_assistant(self.draft_dir, self.dtype, self.device, self.load_format)
        check_gemma4_target(model.config, self.target_config)
        return model

    def kv_cache_spec(self, block_size: int) -> None:
        return None

    def bind_target(self, target_runner) -> None:
        self.runner = Gemma4AssistantRunner(self.model, target_runner)

    def advance_draft_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions  # constant (module docstring)
