"""The generic autoregressive drafting loop (draft model, EAGLE, MTP, ...)."""

from __future__ import annotations

import torch

from specula.runtime.engine.sampler import SamplingMetadata, sample
from specula.runtime.spec_decode.base import DraftProposal, SpeculatorInput
from specula.runtime.spec_decode.draft_model_base import DraftModelSpeculator


class AutoRegressiveSpeculator(DraftModelSpeculator):
    """Drafts ``k`` tokens one after another with the draft network.

    Step 1 is a *prefill over the verified tokens*: each request feeds the tokens the
    draft has not seen yet (the whole prompt for a new request; the last emitted token,
    plus the last draft token when all were accepted, afterwards), and samples draft
    token 1 from the last position. Steps 2..k feed the previous draft token alone.

    Hooks for subclasses: :meth:`advance_draft_positions`, :attr:`model_returns_tuple`,
    :meth:`load_draft_model`, :meth:`sample_draft`.
    """

    model_returns_tuple: bool = False
    """True when the draft network returns ``(hidden_states, aux)`` instead of hidden
    states (EAGLE-style heads that also return their pre-norm state)."""

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

    def _hidden(self, output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        return output[0] if self.model_returns_tuple else output

    def propose(self, inputs: SpeculatorInput, num_speculative_tokens: int) -> DraftProposal:
        """Draft ``num_speculative_tokens`` tokens per request.

        Raises:
            ValueError: ``num_speculative_tokens`` outside ``[1, max_num_speculative_tokens]``.
        """
        self.check_num_speculative_tokens(num_speculative_tokens)
        k = num_speculative_tokens
        slots = inputs.slot_ids
        num_reqs = len(slots)
        starts = [self.num_cached_tokens[s] for s in slots]
        chunks = [toks[start:] for toks, start in zip(inputs.token_ids, starts, strict=True)]
        query_lens = [len(c) for c in chunks]
        input_ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long)
        hidden = self._hidden(self.runner.forward(slots, input_ids, query_lens, starts))
        last = torch.tensor(query_lens).cumsum(0) - 1  # [num_reqs] index of each last token
        # Positions of the tokens just fed, one per request: [num_reqs]
        cache_pos = [len(t) - 1 for t in inputs.token_ids]
        rope_pos = torch.tensor(cache_pos, dtype=torch.long, device=self.device)

        draft_ids = self.draft_token_ids[:num_reqs, :k]  # [num_reqs, k]
        probs_steps: list[torch.Tensor | None] = []
        for step in range(k):
            logits = self.runner.compute_logits(hidden[last])  # [num_reqs, vocab_size]
            token_ids, probs = self.sample_draft(logits, inputs.sampling)
            draft_ids[:, step] = token_ids
            probs_steps.append(probs)
            if step == k - 1:
                break
            # The last draft token is never fed: the target verifies it, and if accepted
            # the next step's prefill feeds it.
            cache_pos = [p + 1 for p in cache_pos]
            rope_pos = self.advance_draft_positions(rope_pos)
            hidden = self._hidden(
                self.runner.forward(slots, token_ids, [1] * num_reqs, cache_pos, rope_pos)
            )
            last = torch.arange(num_reqs)

        for slot, pos in zip(slots, cache_pos, strict=True):
            self.num_cached_tokens[slot] = pos + 1
        draft_probs = None if probs_steps[0] is None else torch.stack(probs_steps, dim=1)
        return DraftProposal(draft_token_ids=draft_ids.clone(), draft_probs=draft_probs)
