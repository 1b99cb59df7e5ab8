"""The Gemma4 MTP draft (``gemma4_assistant``) on the kernels, over the target's paged KV cache."""

from __future__ import annotations

import torch

from specula.runtime.kernels.layernorm import rms_norm
from specula.runtime.models.gemma4_assistant import Gemma4AssistantForCausalLM
from specula.runtime.models.gemma4_config import SLIDING
from specula.runtime.worker.gemma4_runner import Gemma4PagedLayers, Gemma4Runner
from specula.runtime.worker.paged_kv import PagedAttentionMetadata


class Gemma4AssistantRunner(Gemma4PagedLayers):
    """Runs a :class:`Gemma4AssistantForCausalLM` (on the target's device, in its dtype,
    fitting it: :func:`~specula.runtime.models.gemma4_assistant.check_gemma4_target`) over
    the cache, token embedding and rotary length of the :class:`Gemma4Runner` ``target``.

    Raises:
        ValueError: an assistant in another dtype.
    """

    def __init__(self, model: Gemma4AssistantForCausalLM, target: Gemma4Runner) -> None:
        text = model.config.text
        producers = target.config.kv_producer_layers()
        super().__init__(
            text, target.kv_cache,
            # Non-shared target layers are a prefix: cache entry == layer index.
            [producers[t] for t in text.layer_types],
            [model.sliding_window if t == SLIDING else None for t in text.layer_types],
            model.rotary.by_type, target.max_model_len,
            None,  # attn_num_splits: the kernel's choice
            model.pre_projection.weight)
        self.model, self.target = model, target

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: PagedAttentionMetadata,
                backbone: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step (:mod:`~specula.runtime.spec_decode.gemma4`) of ``input_ids``
        and ``positions`` ([num_reqs] int64) with ``backbone [num_reqs,
        backbone_hidden_size]``; ``metadata``: one query row per request.

        Returns:
            ``(hidden [num_reqs, hidden_size] after the final norm, next backbone
            [num_reqs, backbone_hidden_size])``.
        """
        embeds = self.target.model.model.embed(input_ids)  # [num_reqs, backbone]
        x = self.model.pre_projection(torch.cat([embeds, backbone.to(embeds.dtype)], dim=-1))
        for i, layer in enumerate(self.model.model.layers):
            x = self._layer(layer, x, None, positions, i, metadata, {})
        norm = self.model.model.norm
        hidden = rms_norm(x, norm.weight, norm.eps)
        return hidden, self.model.post_projection(hidden)
