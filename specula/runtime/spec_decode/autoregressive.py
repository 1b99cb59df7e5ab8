"""The generic autoregressive drafting loop (draft model, EAGLE, MTP, ...).

Two input layouts share the loop:

- **Token-only drafts** (a plain draft model, Leviathan et al., arXiv 2211.17192): the
  draft row at cache position ``p`` reads token ``t_p``. Its KV at speculated positions
  is exactly what an accepted draft token needs, so it is kept (rollback trims it).
- **Hidden-state-conditioned drafts** (EAGLE, arXiv 2401.15077 / 2503.01840; DeepSeek
  MTP, arXiv 2412.19437): the draft row at cache position ``p`` reads token ``t_{p+1}``
  together with a conditioning row, the target's hidden state at ``p`` (delivered by
  :meth:`observe_target`, stored per slot until drafted over). Later one-token steps
  read the previous draft token with the draft's own hidden state in place of the
  target's, so the KV they leave is not what the target's states would give: the cached
  length goes back to the committed prefix and the next prefill recomputes them (as
  vLLM's ``EagleProposer`` does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specula.runtime.engine.sampler import SamplingMetadata, sample
from specula.runtime.spec_decode.base import DraftProposal, SpeculatorInput, TargetHiddenStates
from specula.runtime.spec_decode.draft_model_base import DraftModelSpeculator


@dataclass
class DraftPrefill:
    """The first draft forward of a :meth:`AutoRegressiveSpeculator.propose` call."""

    input_ids: torch.Tensor
    """[num_tokens] int64, requests' rows concatenated in order."""
    query_lens: list[int]
    """Rows per request (each >= 1)."""
    start_positions: list[int]
    """Per request, the draft cache position of its first row."""
    positions: torch.Tensor
    """[num_tokens] rotary positions."""
    hidden_states: torch.Tensor | None
    """[num_tokens, H] conditioning rows; ``None`` for token-only drafts."""


class AutoRegressiveSpeculator(DraftModelSpeculator):
    """Drafts ``k`` tokens one after another with the draft network.

    Step 1 is a *draft prefill over the verified tokens*: each request feeds the rows the
    draft has not seen yet (see the module docstring for what a row holds) and samples
    draft token 1 from its last row. Steps 2..k feed the previous draft token alone (with
    the draft's own hidden state when conditioned).

    Hooks for subclasses: :attr:`conditions_on_hidden_states`,
    :meth:`conditioning_from_target`, :meth:`advance_draft_positions`,
    :attr:`model_returns_tuple`, :meth:`load_draft_model`, :meth:`sample_draft`; drafts
    that run differently (reading the target's KV) override ``run_draft_model``.
    """

    model_returns_tuple: bool = False
    """True when the draft network returns ``(hidden_for_logits, hidden_for_next_step)``
    (EAGLE-3's normed and pre-norm states, Gemma4's draft and backbone states); False when
    it returns one ``[n, H]`` tensor used for both."""

    conditions_on_hidden_states: bool = False
    """True for hidden-state-conditioned drafts (EAGLE, MTP): the draft network's forward
    takes a fifth argument ``hidden_states [n, H]``, row ``p`` reads token ``t_{p+1}``, and
    speculated positions are recomputed. Subclasses that set it also set
    :attr:`uses_target_hidden_states`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pending: list[list[torch.Tensor]] = [[] for _ in range(self.max_num_seqs)]
        """Per slot: conditioning rows observed for positions ``num_cached_tokens[slot]``
        onwards, not yet drafted over (each ``[rows, H]``)."""

    # ---- hooks ----------------------------------------------------------------------

    def advance_draft_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotary positions of the next draft step from the current ones, ``[num_reqs]``.
        The plain next position; methods with constant draft positions override this."""
        return positions + 1

    def sample_draft(
        self, logits: torch.Tensor, sampling: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pick draft tokens from ``logits [num_reqs, vocab_size]``: argmax for greedy
        requests, a sample from the processed distribution otherwise.

        Returns ``(token_ids [num_reqs], probs [num_reqs, vocab_size] | None)``.
        """
        return sample(logits, sampling)

    def conditioning_from_target(self, states: TargetHiddenStates) -> torch.Tensor:
        """The conditioning rows ``[sum(states.num_rows), H]`` to keep from one target
        forward. Default: the target's final hidden states (MTP); EAGLE-3 overrides it
        to fuse the auxiliary states (``fc``) once, on arrival."""
        return states.hidden_states

    # ---- state ----------------------------------------------------------------------

    def add_requests(self, slot_ids: list[int]) -> None:
        super().add_requests(slot_ids)
        for slot in slot_ids:
            self._pending[slot] = []

    def observe_target(self, states: TargetHiddenStates) -> None:
        if not self.conditions_on_hidden_states:
            return
        rows = self.conditioning_from_target(states)
        offset = 0
        for slot, start, n in zip(
            states.slot_ids, states.start_positions, states.num_rows, strict=True
        ):
            expected = self.num_cached_tokens[slot] + sum(t.shape[0] for t in self._pending[slot])
            assert start == expected, f"slot {slot}: target rows from {start}, expected {expected}"
            self._pending[slot].append(rows[offset : offset + n])
            offset += n

    # ---- the loop -------------------------------------------------------------------

    def _forward(
        self,
        slot_ids: list[int],
        input_ids: torch.Tensor,
        query_lens: list[int],
        start_positions: list[int],
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward -> ``(hidden_for_logits, hidden_for_next_step)``."""
        out = self.run_draft_model(
            slot_ids, input_ids, query_lens, start_positions, positions, hidden_states
        )
        return out if self.model_returns_tuple else (out, out)

    def pending_conditioning(self, slot: int) -> torch.Tensor | None:
        """The conditioning rows ``[rows, H]`` observed for ``slot`` from position
        ``num_cached_tokens[slot]`` on and not drafted over yet (``None``: none)."""
        pending = self._pending[slot]
        return torch.cat(pending) if pending else None

    def prepare_draft_prefill(self, inputs: SpeculatorInput) -> DraftPrefill:
        """The draft prefill of one :meth:`propose`: every request's rows from its
        ``num_cached_tokens`` on (see the module docstring for what a row reads).
        Drafts that need only the last row (reading the target's KV) override this;
        the cached length becomes ``start_positions[i] + query_lens[i]`` either way
        for conditioned drafts.

        Raises:
            AssertionError: a conditioned draft lacks target rows for its prefill (the
                engine did not deliver every committed position).
        """
        shift = 1 if self.conditions_on_hidden_states else 0
        starts = [self.num_cached_tokens[s] for s in inputs.slot_ids]
        chunks = [
            toks[start + shift :] for toks, start in zip(inputs.token_ids, starts, strict=True)
        ]
        query_lens = [len(c) for c in chunks]
        input_ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long)
        positions = torch.cat(
            [torch.arange(s, s + q) for s, q in zip(starts, query_lens, strict=True)]
        ).to(self.device)
        hidden = None
        if shift:
            rows = [self.pending_conditioning(slot) for slot in inputs.slot_ids]
            for slot, r, q in zip(inputs.slot_ids, rows, query_lens, strict=True):
                n = 0 if r is None else r.shape[0]
                assert n == q, f"slot {slot}: {n} target rows pending, the draft prefill needs {q}"
            hidden = torch.cat(rows)  # type: ignore[arg-type]
        return DraftPrefill(input_ids, query_lens, starts, positions, hidden)

    def propose(self, inputs: SpeculatorInput, num_speculative_tokens: int) -> DraftProposal:
        """Draft ``num_speculative_tokens`` tokens per request.

        Raises:
            ValueError: ``num_speculative_tokens`` outside ``[1, max_num_speculative_tokens]``.
        """
        self.check_num_speculative_tokens(num_speculative_tokens)
        k = num_speculative_tokens
        slots = inputs.slot_ids
        num_reqs = len(slots)
        prefill = self.prepare_draft_prefill(inputs)
        starts, query_lens = prefill.start_positions, prefill.query_lens
        h_logits, h_next = self._forward(
            slots, prefill.input_ids, query_lens, starts, prefill.positions, prefill.hidden_states
        )
        last = torch.tensor(query_lens).cumsum(0) - 1  # [num_reqs] index of each last row
        cache_pos = [s + q - 1 for s, q in zip(starts, query_lens, strict=True)]
        rope_pos = prefill.positions[last.to(self.device)]  # [num_reqs]

        draft_ids = self.draft_token_ids[:num_reqs, :k]  # [num_reqs, k]
        probs_steps: list[torch.Tensor | None] = []
        for step in range(k):
            logits = self.compute_draft_logits(h_logits[last])  # [num_reqs, vocab_size]
            token_ids, probs = self.sample_draft(logits, inputs.sampling)
            draft_ids[:, step] = token_ids
            probs_steps.append(probs)
            if step == k - 1:
                break
            # The last draft token is never fed: the target verifies it, and if accepted
            # the next step's prefill feeds it.
            cond = h_next[last] if self.conditions_on_hidden_states else None
            cache_pos = [p + 1 for p in cache_pos]
            rope_pos = self.advance_draft_positions(rope_pos)
            h_logits, h_next = self._forward(
                slots, token_ids, [1] * num_reqs, cache_pos, rope_pos, cond
            )
            last = torch.arange(num_reqs)

        if self.conditions_on_hidden_states:
            for slot, start, q in zip(slots, starts, query_lens, strict=True):
                self.num_cached_tokens[slot] = start + q
                self._pending[slot] = []
        else:
            for slot, pos in zip(slots, cache_pos, strict=True):
                self.num_cached_tokens[slot] = pos + 1
        draft_probs = None if probs_steps[0] is None else torch.stack(probs_steps, dim=1)
        return DraftProposal(draft_token_ids=draft_ids.clone(), draft_probs=draft_probs)
