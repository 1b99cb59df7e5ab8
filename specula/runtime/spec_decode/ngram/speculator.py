"""The ``ngram`` method: n-gram prompt lookup, no draft network.

Saxena, "Prompt Lookup Decoding" (2023, github.com/apoorvumang/prompt-lookup-decoding);
vLLM's ``ngram`` speculative method (``prompt_lookup_min`` / ``prompt_lookup_max``).
"""

from __future__ import annotations

import torch

from specula.runtime.spec_decode.base import BaseSpeculator, DraftProposal, SpeculatorInput

PAD_TOKEN_ID = 0
"""Fills draft positions past a request's real draft. The engine verifies only the real
ones; padding is a valid token id so the verifier's shapes and gathers stay uniform."""


def find_ngram_draft(
    token_ids: list[int], prompt_lookup_min: int, prompt_lookup_max: int, k: int
) -> list[int]:
    """Draft tokens for ``token_ids`` by prompt lookup.

    For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min`` (longest first),
    find the most recent earlier occurrence of the last ``n`` tokens (an occurrence that
    starts before the suffix itself; it may overlap it) and return the up to ``k`` tokens
    that followed it, fewer when the sequence ends first. The first ``n`` with a match
    wins.

    Args:
        token_ids: prompt + generated tokens, length ``L``.
        prompt_lookup_min, prompt_lookup_max: n-gram sizes, ``1 <= min <= max``.
        k: most tokens to propose (>= 0).

    Returns:
        ``0 .. k`` token ids; empty when no n-gram of the allowed sizes recurs.

    Cost: ``O(L * n)`` per ``n`` tried, in vectorised comparisons.
    """
    length = len(token_ids)
    if k <= 0 or length < 2:
        return []
    seq = torch.tensor(token_ids, dtype=torch.long)  # [L]
    for n in range(min(prompt_lookup_max, length - 1), prompt_lookup_min - 1, -1):
        # Windows starting at 0 .. L-n-1: every n-gram before the suffix itself.
        windows = seq[:-1].unfold(0, n, 1)  # [L - n, n]
        hits = (windows == seq[-n:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return token_ids[start : start + k]
    return []


class NgramSpeculator(BaseSpeculator):
    """Proposes, per request, the tokens that followed the last earlier occurrence of its
    trailing n-gram (:func:`find_ngram_draft`). Stateless and model-free.

    A request with no match drafts 0 tokens that step; drafts shorter than ``k`` are
    padded with :data:`PAD_TOKEN_ID` and their real lengths reported in
    :attr:`DraftProposal.num_draft_tokens`.

    Proposals are deterministic, so the draft distribution of a sampled request is
    one-hot at the proposed token: the verifier accepts it with probability ``p(x)`` and
    otherwise samples the recovered token from ``norm(max(0, p - onehot(x)))``, which
    keeps the target's distribution (Leviathan et al., arXiv 2211.17192).

    Raises (at construction):
        ValueError: ``prompt_lookup_min < 1`` or ``prompt_lookup_min > prompt_lookup_max``.
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        vocab_size: int,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        device: torch.device,
    ) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= "
                f"prompt_lookup_max ({prompt_lookup_max})"
            )
        self.max_num_speculative_tokens = num_speculative_tokens
        self.vocab_size = vocab_size
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.device = device

    def init_cudagraph_manager(self) -> None:
        """No-op: lookup runs no network."""

    def capture(self) -> None:
        """No-op: lookup runs no network."""

    def propose(self, inputs: SpeculatorInput, num_speculative_tokens: int) -> DraftProposal:
        """Look up up to ``num_speculative_tokens`` draft tokens per request.

        Returns draft_token_ids ``[num_reqs, k]`` (padded), draft_probs
        ``[num_reqs, k, vocab_size]`` one-hot (``None`` when every request is greedy) and
        ``num_draft_tokens`` (real draft length per request, ``0 .. k``).

        Raises:
            ValueError: ``num_speculative_tokens`` outside ``[1, max_num_speculative_tokens]``.
        """
        self.check_num_speculative_tokens(num_speculative_tokens)
        k = num_speculative_tokens
        drafts = [
            find_ngram_draft(toks, self.prompt_lookup_min, self.prompt_lookup_max, k)
            for toks in inputs.token_ids
        ]
        draft_ids = torch.full((len(drafts), k), PAD_TOKEN_ID, dtype=torch.long)
        for i, draft in enumerate(drafts):
            draft_ids[i, : len(draft)] = torch.tensor(draft, dtype=torch.long)
        draft_ids = draft_ids.to(self.device)  # [num_reqs, k]
        draft_probs = None
        if not inputs.sampling.all_greedy:
            # One-hot at padding too: a padded position then verifies like any
            # deterministic proposal, so whatever the verifier emits there is a valid
            # sample of the target.
            draft_probs = torch.nn.functional.one_hot(draft_ids, self.vocab_size).float()
        return DraftProposal(
            draft_token_ids=draft_ids,
            draft_probs=draft_probs,
            num_draft_tokens=[len(d) for d in drafts],
        )
