"""The generic autoregressive drafting loop (draft model, EAGLE-3, MTP, Gemma4 MTP) on the
paged cache, eager and in CUDA graphs (vLLM Model Runner V2's ``AutoRegressiveSpeculator``,
PR #43241; draft prefill on the target's captured attention state, PR #40410).

A proposal has two stages, neither copying device data to the host:

1. **Draft prefill** over the target forward's own token slots (same block tables, slot
   mapping and positions, so its graph reads the target graph's captured attention state).

   - *Hidden-state-conditioned drafts* (EAGLE, arXiv 2401.15077 / 2503.01840; DeepSeek
     MTP, arXiv 2412.19437): the row at position ``p`` reads token ``t_{p+1}`` with the
     target's state at ``p`` (:func:`~specula.runtime.kernels.draft_inputs.
     prepare_draft_inputs`); each request's last accepted row gives draft 1. Rows of
     rejected drafts write KV that the next verification's rows overwrite.
   - *Token-only drafts* (a plain draft model, Leviathan et al., arXiv 2211.17192): the
     row at ``p`` reads ``t_p``. Verified drafts' KV was written when they were drafted,
     so this stage runs only for prefills (and when nothing is drafted).
   - *Drafts on the target's KV* (Gemma4 MTP) have no prefill: their first step reads
     the target's final state at the last accepted row.

2. **Draft decode steps**, one token per request each (token-only drafts: the first step reads the
   last accepted token and the sampled one, rewriting the former's KV), at the positions where the
   next verification's rows go; one graph per ``(padded requests, steps)``.
"""

from __future__ import annotations

import torch

from specula.runtime.engine.sampler import STREAM_DRAFT, SamplingMetadata, sample
from specula.runtime.kernels.draft_inputs import prepare_draft_inputs
from specula.runtime.kernels.gemv import argmax
from specula.runtime.spec_decode.base import DraftOutput, ProposeInputs
from specula.runtime.spec_decode.draft_model_base import DraftModelSpeculator
from specula.runtime.worker.cudagraph import BatchExecutionDescriptor, CapturedAttentionState


class AutoRegressiveSpeculator(DraftModelSpeculator):
    """Drafts ``k`` tokens one after another with the draft network (module docstring);
    subclasses set the class attributes and override the hooks below."""

    conditions_on_hidden_states: bool = False
    """The draft reads a conditioning state with each token (EAGLE, MTP): its runner's
    forward takes ``hidden_states [n, H]`` and row ``p`` reads token ``t_{p+1}``."""

    model_returns_tuple: bool = False
    """The runner returns ``(hidden_for_logits, hidden_for_next_step)`` (EAGLE-3's normed
    and pre-norm states, Gemma4's draft and backbone states); else the first element of
    what it returns serves both (MTP's one state; a plain draft's ``(hidden, None)``)."""

    reads_target_kv: bool = False
    """Draft rows attend to the target's cache up to (not including) their position and
    write no KV (Gemma4 MTP); there is no draft prefill."""

    def advance_draft_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotary positions ``[num_reqs]`` of the next draft step from the current ones: a
        constant shift (:func:`~specula.runtime.kernels.draft_inputs.draft_steps` applies
        it to all steps at once)."""
        return positions + 1

    def conditioning(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """The conditioning rows ``[n, H]`` from the target's final states ``hidden`` and
        auxiliary states ``aux`` of the same rows (default: ``hidden``)."""
        return hidden

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, H] -> [n, target vocab_size]`` float32; ids a draft cannot propose get ``-inf``."""
        return self.model.compute_logits(hidden)

    def draft_argmax(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Greedy drafts ``[n]`` int64 target ids from ``hidden [n, H]``, written to ``out``
        ([n] int64, contiguous; the argmax kernel's own output where it can be)."""
        return argmax(self.compute_draft_logits(hidden), out)

    def sample_draft(self, hidden: torch.Tensor, sampling: SamplingMetadata, keys: torch.Tensor,
                     step: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft ``step`` (0-based) of each request from ``hidden [num_reqs, H]``: the
        argmax (``draft_sample_method: greedy``) or a sample (``probabilistic``), written to
        ``out`` [num_reqs] int64: returns ``(out, probs [num_reqs, vocab_size] | None)``."""
        if not self.keeps_draft_probs:
            return self.draft_argmax(hidden, out), None
        tokens, probs = sample(self.compute_draft_logits(hidden), sampling, keys, STREAM_DRAFT + step)
        return out.copy_(tokens), probs

    def num_lookahead_tokens(self, num_speculative_tokens: int) -> int:
        return 0 if self.reads_target_kv else num_speculative_tokens

    def init_cudagraph_manager(self) -> None:
        super().init_cudagraph_manager()
        r, k = self.max_num_seqs, max(self.max_num_speculative_tokens, 1)
        dev = self.device
        i64 = {"dtype": torch.int64, "device": dev}
        self.num_accepted = torch.zeros(r, **i64)
        self.prev_token_ids = torch.zeros(r, **i64)
        """[max_num_seqs] the token before the sampled one (token-only drafts' first step)."""
        self.cu_num_draft_tokens = torch.zeros(r, dtype=torch.int32, device=dev)
        self.keys = torch.zeros(r, **i64)
        self.last_token_indices = torch.zeros(r, **i64)
        self.prefill_input_ids = torch.zeros(r * (k + 1), **i64)
        self.prefill_positions = torch.zeros(r * (k + 1), **i64)
        self.pair_offsets = torch.tensor([-1, 0], **i64)
        """A token-only draft's first step: the last accepted token's position and the next."""
        at = [int(self.advance_draft_positions(torch.tensor(p))) for p in (0, 1)]
        if at[1] - 1 != at[0]:
            raise ValueError(f"advance_draft_positions must shift by a constant, got 0 -> {at[0]}, 1 -> {at[1]}")
        self.position_shift = at[0]
        self.sampling = SamplingMetadata(
            torch.zeros(r, device=dev), torch.ones(r, device=dev), torch.zeros(r, **i64),
            torch.zeros(r, **i64), all_greedy=not self.keeps_draft_probs,
            needs_top_k=self.keeps_draft_probs, needs_top_p=self.keeps_draft_probs)
        # Drafts on the target's KV carry the target's state (Gemma4's backbone width).
        h = (self.target_config if self.reads_target_kv else self.model.config).hidden_size
        self.hidden = torch.zeros(r, h, dtype=self.dtype, device=dev)
        """[max_num_seqs, H] the state the next draft step reads."""
        self.draft_probs = (
            torch.zeros(r, k, self.vocab_size, device=dev) if self.keeps_draft_probs else None)

    def capture_graphs(
        self, captured_attention_states: dict[BatchExecutionDescriptor, CapturedAttentionState]
    ) -> None:
        if not self.reads_target_kv:
            for d, state in captured_attention_states.items():
                if not self.conditions_on_hidden_states and d.uniform_query_len > 1:
                    continue  # token-only drafts skip the prefill of verifications
                self.prefill_graphs[d] = self.capture_in_pool(
                    lambda s=state: self._prefill(s.descriptor.num_reqs, s, True))
        steps = range(1, self._num_decode_steps(self.max_num_speculative_tokens) + 1)
        keys = sorted(((r, s) for r in self.capture_sizes for s in steps), reverse=True,
                      key=lambda rs: (rs[0] * rs[1], rs[0]))
        for r, s in keys:
            self.decode_graphs[(r, s)] = self.capture_in_pool(lambda r=r, s=s: self._decode(r, s))

    def _num_decode_steps(self, k: int) -> int:
        return k - 1 if self.conditions_on_hidden_states else k

    def _forward(self, input_ids, positions, metadata, hidden):
        args = (input_ids, positions, metadata)
        out = self.runner.forward(*args, hidden) if hidden is not None else self.runner.forward(*args)
        if self.model_returns_tuple:
            return out
        out = out[0] if isinstance(out, tuple) else out
        return out, out

    def _prefill(self, r: int, target: ProposeInputs | CapturedAttentionState,
                 sample_first: bool) -> None:
        """Stage 1 over the ``r`` requests of the ``target`` forward; conditioned drafts
        write draft 1 to ``draft_token_ids[:, 0]`` and its state to :attr:`hidden`."""
        input_ids, positions, metadata = target.input_ids, target.positions, target.metadata
        if not self.conditions_on_hidden_states:
            self._forward(input_ids, positions, metadata, None)
            return
        ids, pos, last = self._prepare_inputs(input_ids, positions, metadata.query_start_loc, r)
        conditioning = self.conditioning(target.hidden_states, target.aux_hidden_states)
        h_logits, h_next = self._forward(ids, pos, metadata, conditioning)
        torch.index_select(h_next, 0, last, out=self.hidden[:r])  # one launch, no copy
        if sample_first:
            rows = self.hidden[:r] if h_logits is h_next else h_logits[last]
            self._draft(0, rows, self.sampling.select(slice(0, r)), r)

    def _prepare_inputs(self, input_ids, positions, query_start_loc, r: int):
        """:func:`prepare_draft_inputs` of the target forward's ``r`` requests into the static
        buffers (where they fit): ``(ids, positions, last accepted rows [r])``."""
        n = input_ids.shape[0]
        static = n <= self.prefill_input_ids.shape[0]
        return prepare_draft_inputs(
            input_ids, positions, query_start_loc, self.cu_num_draft_tokens[:r], self.num_accepted[:r],
            self.next_token_ids[:r], out_input_ids=self.prefill_input_ids[:n] if static else None,
            out_positions=self.prefill_positions[:n] if static else None,
            out_last_token_indices=self.last_token_indices[:r])

    def _draft(self, col: int, hidden: torch.Tensor, sampling: SamplingMetadata, r: int) -> torch.Tensor:
        """Draft ``col`` of rows ``0..r-1`` from ``hidden [r, H]`` into :attr:`draft_token_ids`
        (and :attr:`draft_probs`); returns the tokens [r]."""
        out = self.draft_token_ids[:r, col]
        tokens, probs = self.sample_draft(hidden, sampling, self.keys[:r], col, out)
        if probs is not None:  # sampled drafts: draft_probs is allocated
            self.draft_probs[:r, col] = probs
        return tokens

    def _decode(self, r: int, num_steps: int) -> None:
        """Stage 2: ``num_steps`` one-token steps for rows ``0..r-1``."""
        offset = 1 if self.conditions_on_hidden_states else 0
        writes_kv = not self.reads_target_kv
        start = self.start_positions[:r, None]  # -1: a padding row
        tokens = self.draft_token_ids[:r, 0] if offset else self.next_token_ids[:r]
        hidden = self.hidden[:r] if self.conditions_on_hidden_states or self.reads_target_kv else None
        sampling = self.sampling.select(slice(0, r))
        # Every step's positions, slots and sequence lengths [num_steps, r] in one launch.
        positions, slots, seq_lens = self.steps(start, num_steps, self.position_shift, writes_kv)
        for step in range(num_steps):
            if step == 0 and hidden is None:  # token-only drafts carry no state
                ids = torch.stack([self.prev_token_ids[:r], tokens], dim=1)  # [r, 2]
                pos, sl, lens = self.steps(start + self.pair_offsets, 1, 0, writes_kv)
            else:
                ids, pos, sl, lens = tokens[:, None], positions[step], slots[step], seq_lens[step]
            q = ids.shape[1]  # consecutive query rows per request
            metadata = self.decode_metadata(sl, self.block_table[:r], lens.reshape(-1), q)
            h_logits, h_next = self._forward(ids.reshape(-1), pos.reshape(-1), metadata, hidden)
            if q > 1:  # each request's last row
                last = torch.arange(r, device=ids.device) * q + (q - 1)
                h_logits, h_next = h_logits[last], h_next[last]
            else:  # views: no launch in a draft step
                h_logits, h_next = h_logits[:r], h_next[:r]
            tokens = self._draft(step + offset, h_logits, sampling, r)
            if hidden is not None:
                hidden = h_next

    def _load(self, inputs: ProposeInputs) -> int:
        r = inputs.num_reqs
        padded = self.load_inputs(inputs, (self.num_accepted[:r], inputs.num_accepted),
                                  (self.cu_num_draft_tokens[:r], inputs.cu_num_draft_tokens))
        if padded > r:  # padding rows of a graph: no drafts, nothing accepted
            self.num_accepted[r:padded] = 0
            k = inputs.descriptor.uniform_query_len - 1 if inputs.descriptor else 0
            steps = torch.arange(1, padded - r + 1, device=self.device, dtype=torch.int32)
            self.cu_num_draft_tokens[r:padded] = inputs.cu_num_draft_tokens[r - 1] + steps * k
        if self.keeps_draft_probs:  # greedy drafts read neither settings nor keys
            self.keys[:r] = inputs.draw_keys
            for name in ("temperature", "top_p", "top_k", "seeds"):
                getattr(self.sampling, name)[:r] = getattr(inputs.sampling, name)
        if not self.conditions_on_hidden_states:  # each request's last accepted row (one launch)
            last = self._prepare_inputs(inputs.input_ids, inputs.positions,
                                        inputs.metadata.query_start_loc[: r + 1], r)[2]
            torch.index_select(inputs.input_ids, 0, last, out=self.prev_token_ids[:r])
            if self.reads_target_kv:
                torch.index_select(inputs.hidden_states, 0, last, out=self.hidden[:r])
        return padded

    @torch.no_grad()
    def propose(self, inputs: ProposeInputs) -> DraftOutput | None:
        k = inputs.num_speculative_tokens
        self.check_num_speculative_tokens(k)
        r = inputs.num_reqs
        padded = self._load(inputs)
        if not self.reads_target_kv and (self.conditions_on_hidden_states or k == 0
                                         or inputs.num_decode < r):
            self.replay_or_run(self.prefill_graphs, inputs.descriptor, "num_prefill_replays",
                               lambda: self._prefill(r, inputs, sample_first=k > 0))
        if k == 0:
            return None
        steps = self._num_decode_steps(k)
        if steps > 0:
            self.replay_or_run(self.decode_graphs, (padded, steps), "num_decode_replays",
                               lambda: self._decode(r, steps))
        probs = None if self.draft_probs is None else self.draft_probs[:r, :k]
        return DraftOutput(self.draft_token_ids[:r, :k], probs)
