"""DFlash block drafting (Chen, Liang, Liu, arXiv 2602.06036; vLLM's ``dflash`` method)
from ``speculators`` ``dflash`` checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specula.runtime.engine.sampler import STREAM_DRAFT, sample
from specula.runtime.models.dflash import DFlashDraftModel, load_dflash_draft
from specula.runtime.spec_decode.base import DraftOutput, ProposeInputs
from specula.runtime.spec_decode.dflash.config import DFlashConfig
from specula.runtime.spec_decode.dflash.runner import DFlashRunner
from specula.runtime.spec_decode.draft_model_base import DraftModelSpeculator
from specula.runtime.worker.cudagraph import BatchExecutionDescriptor, CapturedAttentionState


class DFlashSpeculator(DraftModelSpeculator):
    """Drafts ``k`` tokens per request with ONE forward of the DFlash draft.

    Every step, the context KV of the target forward's rows is written to the draft's
    cache at the target's slots (rows of rejected drafts are overwritten before they are
    read). A request whose sampled token sits at position ``p`` runs the whole block of
    that token (the anchor) and the mask tokens at ``p .. p + block_size - 1``: a shorter
    block would change every slot's prediction (:attr:`DFlashConfig.sample_from_anchor`).

    Raises (at construction):
        ValueError: not a ``speculators`` ``dflash`` checkpoint, or one that does not fit
            the target (:meth:`DFlashConfig.check_target`), or bad weights.
        FileNotFoundError: no ``config.json`` or ``*.safetensors`` in ``draft_dir``.
    """

    model: DFlashDraftModel
    config: DFlashConfig
    embed_weight: torch.Tensor | None = None
    lm_head_weight: torch.Tensor | None = None

    def load_draft_model(self) -> DFlashDraftModel:
        config = self.config = DFlashConfig.from_pretrained(self.draft_dir)
        config.check_target(self.target_config, self.max_num_speculative_tokens)
        self.aux_hidden_state_layers = config.aux_hidden_state_layer_ids
        draft_vocab_size = config.draft_vocab_size
        if draft_vocab_size == config.layer_config.vocab_size:
            draft_vocab_size = None  # the target's LM head
        return load_dflash_draft(self.draft_dir, config.layer_config,
                                 len(self.aux_hidden_state_layers), draft_vocab_size, self.dtype,
                                 self.device, self.load_format)

    def bind_target(self, target_runner) -> None:
        """Share the target's token embedding and LM head (``speculators`` DFlash
        checkpoints store neither), used as plain matrices as the draft was trained."""
        embed, self.lm_head_weight = target_runner.model.full_vocab_weights()
        self.embed_weight = embed.weight

    def build_runner(self, kv_cache, max_model_len: int) -> DFlashRunner:
        return DFlashRunner(self.model, kv_cache, max_model_len)

    def num_lookahead_tokens(self, num_speculative_tokens: int) -> int:
        return self.config.block_size

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, H] -> [n, vocab_size]`` float32 (``-inf`` outside a draft vocabulary)."""
        return self.model.compute_logits(hidden, self.lm_head_weight)

    def capture_graphs(
        self, captured_attention_states: dict[BatchExecutionDescriptor, CapturedAttentionState]
    ) -> None:
        for d, state in captured_attention_states.items():
            self.prefill_graphs[d] = self.capture_in_pool(lambda s=state: self._store_context(s))
        sizes = () if self.keeps_draft_probs else sorted(self.capture_sizes, reverse=True)
        for r in sizes:  # sampled drafts run eagerly
            self.decode_graphs[r] = self.capture_in_pool(lambda r=r: self._greedy_block(r))

    def _store_context(self, target: ProposeInputs | CapturedAttentionState) -> None:
        assert target.aux_hidden_states is not None, "dflash reads auxiliary hidden states"
        self.runner.store_context(target.aux_hidden_states, target.positions, target.metadata.slot_mapping)

    def _block_hidden(self, r: int) -> torch.Tensor:
        """[r, num_drafts_max, H] the block's states at the draft slots."""
        bs, dev = self.config.block_size, self.device
        start = self.start_positions[:r]
        valid = start >= 0
        positions = start.clamp(min=0)[:, None] + torch.arange(bs, device=dev)  # [r, bs]
        ids = torch.full((r, bs), self.config.mask_token_id, dtype=torch.int64, device=dev)
        ids[:, 0] = self.next_token_ids[:r]
        slots, seq_lens = self.slots(positions, valid)  # seq_lens: start + bs, 0 on padding
        metadata = self.decode_metadata(slots, self.block_table[:r].repeat_interleave(bs, dim=0),
                                        seq_lens.repeat_interleave(bs), 1)
        assert self.embed_weight is not None, "bind_target first"
        embeds = F.embedding(ids.reshape(-1), self.embed_weight)
        hidden = self.runner.forward(embeds, positions.reshape(-1), metadata).view(r, bs, -1)
        first = self.config.first_draft_slot
        return hidden[:, first : first + self.max_num_speculative_tokens]

    def _greedy_block(self, r: int) -> None:
        hidden = self._block_hidden(r)
        self.draft_token_ids[:r] = self.compute_logits(hidden.flatten(0, 1)).argmax(-1).view(r, -1)

    @torch.no_grad()
    def propose(self, inputs: ProposeInputs) -> DraftOutput | None:
        k = inputs.num_speculative_tokens
        self.check_num_speculative_tokens(k)
        self.replay_or_run(self.prefill_graphs, inputs.descriptor, "num_prefill_replays",
                           lambda: self._store_context(inputs))
        if k == 0:
            return None
        r = inputs.num_reqs
        padded = self.load_inputs(inputs)
        if not self.keeps_draft_probs or inputs.sampling.all_greedy:
            self.replay_or_run(self.decode_graphs, padded, "num_decode_replays",
                               lambda: self._greedy_block(r))
            return DraftOutput(self.draft_token_ids[:r, :k])
        logits = self.compute_logits(self._block_hidden(r)[:, :k].flatten(0, 1)).view(r, k, -1)
        keys = inputs.draw_keys
        ids, probs = zip(*(sample(logits[:, j], inputs.sampling, keys, STREAM_DRAFT + j)
                           for j in range(k)), strict=True)
        return DraftOutput(torch.stack(ids, dim=1), torch.stack(probs, dim=1))
