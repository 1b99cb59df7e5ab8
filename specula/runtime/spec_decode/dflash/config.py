"""The ``speculators`` ``dflash`` checkpoint config and how it must fit the target.

The checkpoint holds the draft body only; the token embedding is the target's, and so is
the LM head unless the draft has a reduced vocabulary (its own ``lm_head`` and ``d2t``).
``aux_hidden_state_layer_ids`` are vLLM's aux-capture ids, which ``speculators`` trains
on, used unchanged (:func:`~specula.runtime.models.config.check_aux_layer_ids`); vLLM
shifts them only for z-lab checkpoints, whose ``target_layer_ids`` name the layer whose
*output* is taken (``i - 1``, vLLM PR #40727).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specula.runtime.models.config import ModelConfig, check_aux_layer_ids
from specula.runtime.models.speculators_format import layer_model_config, read_speculators_config


@dataclass(frozen=True)
class DFlashConfig:
    """A parsed ``speculators`` ``dflash`` ``config.json``."""

    layer_config: ModelConfig
    """The draft decoder layers (``transformer_layer_config``, Qwen3 when it names no
    ``model_type``); ``vocab_size`` is the target vocabulary the draft was trained for."""
    block_size: int
    """Tokens per block: the anchor (last verified token) plus ``block_size - 1`` mask tokens."""
    mask_token_id: int
    """Token id whose embedding fills the block after the anchor."""
    aux_hidden_state_layer_ids: tuple[int, ...]
    draft_vocab_size: int
    """Rows of the draft LM head (``layer_config.vocab_size``: the target's head)."""
    target_hidden_size: int | None
    """The target hidden size the checkpoint declares, ``None`` when it declares none."""
    sample_from_anchor: bool
    """False (DFlash): the anchor slot predicts nothing and block slot ``j >= 1``
    predicts the token ``j`` positions after the anchor. True (the DSpark layout): slot
    ``j`` predicts the token ``j + 1`` positions after the anchor."""

    @property
    def first_draft_slot(self) -> int:
        return 0 if self.sample_from_anchor else 1

    @property
    def max_num_speculative_tokens(self) -> int:
        """Drafts per block: ``block_size - 1`` (``block_size`` with ``sample_from_anchor``)."""
        return self.block_size - self.first_draft_slot

    @classmethod
    def from_pretrained(cls, checkpoint_dir: Path) -> DFlashConfig:
        """Read ``config.json`` in ``checkpoint_dir``.

        Raises:
            FileNotFoundError: no ``config.json``.
            ValueError: not a ``speculators`` ``dflash`` checkpoint (the message names
                ``speculators_model_type`` and its value), a missing or invalid field,
                or draft layers our runtime does not implement (sliding-window layers).
        """
        raw = read_speculators_config(checkpoint_dir, "dflash")
        layer_config = layer_model_config(raw, default_type="qwen3")
        block_size = raw.get("block_size", 8)
        if not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"block_size {block_size!r} must be an integer >= 2")
        mask_token_id = raw.get("mask_token_id")
        if not isinstance(mask_token_id, int) or not 0 <= mask_token_id < layer_config.vocab_size:
            raise ValueError(f"mask_token_id {mask_token_id!r} must be a token id in "
                             f"[0, {layer_config.vocab_size})")
        layer_ids = raw.get("aux_hidden_state_layer_ids")
        if not layer_ids or len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"aux_hidden_state_layer_ids {layer_ids!r} must be a non-empty "
                             "list of distinct target layer ids")
        draft_vocab_size = raw.get("draft_vocab_size") or layer_config.vocab_size
        if draft_vocab_size > layer_config.vocab_size:
            raise ValueError(f"draft_vocab_size {draft_vocab_size} exceeds the target vocab_size "
                             f"{layer_config.vocab_size} of transformer_layer_config")
        return cls(layer_config=layer_config, block_size=block_size, mask_token_id=mask_token_id,
                   aux_hidden_state_layer_ids=tuple(int(i) for i in layer_ids),
                   draft_vocab_size=int(draft_vocab_size),
                   target_hidden_size=raw.get("target_hidden_size"),
                   sample_from_anchor=bool(raw.get("sample_from_anchor", False)))

    def check_target(self, target: ModelConfig, num_speculative_tokens: int) -> None:
        """Check the draft fits ``target`` and one block yields ``num_speculative_tokens`` (max k).

        Raises:
            ValueError: naming the field and both values: ``vocab_size``, ``hidden_size`` (of the
                draft layers, or a declared ``target_hidden_size``), an
                ``aux_hidden_state_layer_ids`` entry outside ``[0, num_hidden_layers]``, or
                ``max_num_speculative_tokens`` above what one block yields.
        """
        for name, field, ours, why in (
            ("draft vocab_size", "vocab_size", self.layer_config.vocab_size,
             ": the draft was trained for another target"),
            ("draft hidden_size", "hidden_size", self.layer_config.hidden_size,
             ": the draft embeds tokens with the target's embedding"),
            ("target_hidden_size", "hidden_size", self.target_hidden_size, ""),
        ):
            theirs = getattr(target, field)
            if ours is not None and ours != theirs:
                raise ValueError(f"dflash {name} {ours} != target {field} {theirs}{why}")
        check_aux_layer_ids(self.aux_hidden_state_layer_ids, target.num_hidden_layers)
        limit = self.max_num_speculative_tokens
        if num_speculative_tokens > limit:
            anchor = "" if self.sample_from_anchor else " - 1 (the anchor slot drafts nothing)"
            raise ValueError(f"max_num_speculative_tokens {num_speculative_tokens} exceeds the "
                             f"{limit} draft tokens one dflash block yields (block_size "
                             f"{self.block_size}{anchor})")
