"""The ``draft_model`` method: an independent causal LM drafts autoregressively."""

from __future__ import annotations

from specula.runtime.models.llama import LlamaForCausalLM
from specula.runtime.models.registry import load_model
from specula.runtime.spec_decode.autoregressive import AutoRegressiveSpeculator


class PlainDraftModelSpeculator(AutoRegressiveSpeculator):
    """A Hugging Face-layout causal LM (any architecture in the model registry) used
    as the draft, with its own KV cache; everything else is the generic loop."""

    def load_draft_model(self) -> LlamaForCausalLM:
        return load_model(self.draft_dir, self.dtype, self.device)
