"""The ``gemma4_mtp`` method: a ``gemma4_assistant`` checkpoint drafts for a Gemma4
target by reading the target's KV cache.

Per :meth:`propose`, with verified tokens ``t_0 .. t_{n-1}`` (``t_{n-1}`` just emitted,
its KV not yet in the target's cache): every draft step runs one row per request at the
constant rotary position ``n - 1``, attending to the target's cached positions
``0 .. n - 2`` (sliding layers: the last ``sliding_window + 1`` of them). Step 1 reads
``t_{n-1}`` with the target's final hidden state at ``n - 2``; step ``s`` reads draft
token ``s - 1`` with the assistant's own ``post_projection`` output. This is what
``transformers``' ``SinglePositionMultiTokenCandidateGenerator`` does for
``generate(..., assistant_model=...)``, with one difference after a partially rejected
round: there the rows also see the target's KV of rejected draft tokens (full layers
the first one, since the shared KV is cropped to the sequence length, one past the
committed cache; sliding layers all of them, since the sliding cache hands over only
the last window plus the verified block, which the crop leaves whole). Here rows see
committed positions only. Either way the output is the target's; only acceptance can
differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specula.runtime.models.attention import build_attention_metadata, with_sliding_window
from specula.runtime.models.gemma4_assistant import (
    Gemma4AssistantForCausalLM,
    check_gemma4_target,
    load_gemma4_assistant,
)
from specula.runtime.models.gemma4_config import SLIDING
from specula.runtime.spec_decode.autoregressive import AutoRegressiveSpeculator, DraftPrefill
from specula.runtime.spec_decode.base import SpeculatorInput

if TYPE_CHECKING:
    from specula.runtime.engine.kv_cache import KVCache
    from specula.runtime.engine.model_runner import ModelRunner


class Gemma4MTPSpeculator(AutoRegressiveSpeculator):
    """Gemma4 MTP over the generic loop: Q-only draft layers on the target's KV,
    constant draft positions, the target's token embedding, ``(draft_hidden,
    backbone_hidden)`` output.

    Raises (at construction):
        ValueError: not a ``gemma4_assistant`` checkpoint, or one that does not fit the
            target (a non-Gemma4 target, a different backbone hidden size, vocabulary,
            head size or layer type); the message names the field and both values.
    """

    uses_target_hidden_states = True
    conditions_on_hidden_states = True
    model_returns_tuple = True
    model: Gemma4AssistantForCausalLM

    def load_draft_model(self) -> Gemma4AssistantForCausalLM:
        return load_gemma4_assistant(self.draft_dir, self.dtype, self.device)

    def check_draft_model(self, model: Gemma4AssistantForCausalLM) -> None:
        check_gemma4_target(model.config, self.target_config)

    def create_kv_cache(self, max_len: int) -> KVCache | None:
        """None: the draft reads the target's KV cache and keeps none of its own."""
        return None

    def bind_target(self, target_runner: ModelRunner) -> None:
        """Keep the target runner (its KV cache and token embedding).

        Raises:
            ValueError: the target does not fit the draft (see
                :func:`~specula.runtime.models.gemma4_assistant.check_gemma4_target`).
        """
        target = target_runner.model
        check_gemma4_target(self.model.config, target.config)
        self.target_runner = target_runner
        producers = target.config.kv_producer_layers()
        # KV-cache index == layer index for non-shared layers (they are a prefix).
        self.kv_layer_by_type = {t: producers[t] for t in self.model.config.text.layer_types}

    def advance_draft_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Constant: every draft step sits at the last verified token's position."""
        return positions

    def prepare_draft_prefill(self, inputs: SpeculatorInput) -> DraftPrefill:
        """One row per request: the last verified token ``t_{n-1}`` with the target's
        hidden state at ``n - 2`` (the last pending conditioning row), cache position
        ``n - 2``, rotary position ``n - 1``.

        Raises:
            AssertionError: no target row pending for a request.
        """
        input_ids, rows, starts = [], [], []
        for slot, tokens in zip(inputs.slot_ids, inputs.token_ids, strict=True):
            pending = self.pending_conditioning(slot)
            assert pending is not None, f"slot {slot}: no target hidden state pending"
            assert self.num_cached_tokens[slot] + pending.shape[0] == len(tokens) - 1
            input_ids.append(tokens[-1])
            rows.append(pending[-1:])
            starts.append(len(tokens) - 2)
        positions = torch.tensor(starts, dtype=torch.long, device=self.device) + 1
        return DraftPrefill(
            input_ids=torch.tensor(input_ids, dtype=torch.long),
            query_lens=[1] * len(starts),
            start_positions=starts,
            positions=positions,
            hidden_states=torch.cat(rows),
        )

    def run_draft_model(
        self,
        slot_ids: list[int],
        input_ids: torch.Tensor,
        query_lens: list[int],
        start_positions: list[int],
        positions: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over the target's KV: row ``i`` at rotary position
        ``positions[i]`` sees target cache positions ``< positions[i]``.

        Args:
            input_ids: [num_reqs] token of each row.
            positions: [num_reqs] the constant draft positions.
            hidden_states: [num_reqs, backbone_hidden_size] backbone state of each row.

        Returns:
            ``(draft_hidden [num_reqs, H], backbone_hidden [num_reqs, backbone_hidden_size])``.
        """
        assert all(q == 1 for q in query_lens) and positions is not None
        assert hidden_states is not None
        target = self.target_runner
        embeds = target.model.model.embed(input_ids.to(self.device))  # [num_reqs, backbone]
        inputs_embeds = torch.cat([embeds, hidden_states.to(embeds.dtype)], dim=-1)
        # Query cache position p - 1 makes the causal mask admit exactly positions < p.
        metadata = build_attention_metadata(
            slot_ids, query_lens, (positions - 1).tolist(), self.device
        )
        by_type = {t: metadata for t in self.kv_layer_by_type}
        if SLIDING in by_type:
            by_type[SLIDING] = with_sliding_window(metadata, self.model.sliding_window)
        caches = {t: target.kv_cache.layers[i] for t, i in self.kv_layer_by_type.items()}
        return self.model(inputs_embeds, positions, caches, by_type)
