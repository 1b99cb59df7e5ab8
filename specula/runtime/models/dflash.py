"""The DFlash draft network (Chen, Liang, Liu, "DFlash: Block Diffusion for Flash
Speculative Decoding", arXiv 2602.06036), in the ``speculators`` ``dflash`` layout: Qwen3
decoder layers whose queries are a block of target-embedded tokens and whose keys and
values are the *context* (the target's auxiliary hidden states at every earlier position
through ``fc``, ``hidden_norm`` and each layer's ``k_proj``/``v_proj``, ``k_norm`` and
rotary embedding) then the block's own, non-causal within the block. The paged forwards
are :class:`~specula.runtime.spec_decode.dflash.runner.DFlashRunner`'s.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from torch import nn

from specula.runtime.kernels.gemv import linear
from specula.runtime.models.config import ModelConfig
from specula.runtime.models.layers import RMSNorm, RotaryEmbedding
from specula.runtime.models.llama import LlamaForCausalLM
from specula.runtime.models.qwen3 import Qwen3DecoderLayer
from specula.runtime.models.registry import load_checkpoint
from specula.runtime.models.speculators_format import (
    draft_vocab_ids,
    speculators_weight_name,
    target_vocab_logits,
)


class DFlashDraftModel(nn.Module):
    """Draft layers, ``fc``/``hidden_norm`` over the context features, the final
    ``norm``, and, for a reduced draft vocabulary, ``lm_head`` and ``draft_to_target``.

    Args:
        config: the draft layers' hyper-parameters (``transformer_layer_config``).
        num_aux_layers: how many target hidden states are concatenated per position.
        draft_vocab_size: rows of the draft's own LM head; ``None``: it uses the target's head.
    """

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config: ModelConfig, num_aux_layers: int, draft_vocab_size: int | None,
                 device: torch.device) -> None:
        super().__init__()
        self.config, hidden = config, config.hidden_size
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(num_aux_layers * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = None
        if draft_vocab_size is not None:
            self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
            self.register_buffer("draft_to_target", torch.arange(draft_vocab_size),
                                 persistent=False)
        self.rotary = RotaryEmbedding.from_config(config, device)

    def context_features(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, num_aux_layers * hidden_size]`` target states ->
        ``[num_tokens, hidden_size]`` context features (``hidden_norm(fc(.))``)."""
        return self.hidden_norm(self.fc(aux_hidden_states))

    def compute_logits(self, hidden: torch.Tensor,
                       target_lm_head_weight: torch.Tensor) -> torch.Tensor:
        """``[num_positions, hidden_size]`` -> ``[num_positions, target_vocab_size]``
        float32 logits over the *target* vocabulary (``-inf`` outside a reduced draft
        vocabulary: :func:`~specula.runtime.models.speculators_format.target_vocab_logits`)."""
        if self.lm_head is None:
            return linear(hidden, target_lm_head_weight).float()
        vocab_size = target_lm_head_weight.shape[0]
        return target_vocab_logits(self.lm_head(hidden).float(), self.draft_to_target, vocab_size)


def load_dflash_draft(checkpoint_dir: Path, config: ModelConfig, num_aux_layers: int,
                      draft_vocab_size: int | None, dtype: torch.dtype, device: torch.device,
                      load_format: str = "auto") -> DFlashDraftModel:
    """Build a :class:`DFlashDraftModel` and load a ``speculators`` checkpoint into it,
    skipping any ``embed_tokens.weight`` (the draft embeds with the target's, as
    ``speculators`` replaces a stored copy with the verifier's).

    Raises:
        FileNotFoundError: no ``*.safetensors`` file.
        ValueError: a tensor matching no parameter, a missing tensor or shard, a shape mismatch,
            or a bad ``d2t`` (:func:`~specula.runtime.models.speculators_format.draft_vocab_ids`).
    """
    model, _ = load_checkpoint(
        partial(DFlashDraftModel, config, num_aux_layers, draft_vocab_size, device),
        checkpoint_dir, dtype, device, load_format,
        lambda name: None if name == "embed_tokens.weight" else speculators_weight_name(name))
    if draft_vocab_size is not None:  # not a weight: rebuild what to_empty left uninitialised
        model.draft_to_target = draft_vocab_ids(checkpoint_dir, draft_vocab_size, config.vocab_size,
                                                load_format).to(device)
    return model
