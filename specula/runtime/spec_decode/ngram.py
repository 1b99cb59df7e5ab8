"""The ``ngram`` method: n-gram prompt lookup on the device over the engine's token
history (Saxena, "Prompt Lookup Decoding", 2023, github.com/apoorvumang/
prompt-lookup-decoding; vLLM's ``ngram`` method)."""

from __future__ import annotations

import torch

from specula.runtime.spec_decode.base import BaseSpeculator, DraftOutput, ProposeInputs

PAD_TOKEN_ID = 0
"""Fills draft positions past a request's real draft: a valid id, so shapes stay uniform."""


def ngram_lookup(token_ids: torch.Tensor, num_tokens: torch.Tensor, prompt_lookup_min: int,
                 prompt_lookup_max: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft tokens by prompt lookup, for a batch: for ``n`` from ``prompt_lookup_max``
    down to ``prompt_lookup_min``, find the most recent earlier occurrence of a sequence's
    last ``n`` tokens (starting before the suffix; it may overlap it) and propose the up
    to ``k`` tokens that followed it. The first ``n`` with a match wins.

    Args:
        token_ids: [num_reqs, capacity] int64, each row's tokens then anything.
        num_tokens: [num_reqs] int64 valid tokens per row (``L``).
        prompt_lookup_min, prompt_lookup_max: n-gram sizes, ``1 <= min <= max``.
        k: most tokens to propose (>= 1).

    Returns:
        ``(draft_token_ids [num_reqs, k] int64 (:data:`PAD_TOKEN_ID` past the real
        ones), num_draft_tokens [num_reqs] int64 in [0, k])``.

    Cost: ``O(num_reqs * capacity * n)`` comparisons per ``n`` tried, on the device.
    """
    num_reqs, capacity = token_ids.shape
    dev = token_ids.device
    found = torch.zeros(num_reqs, dtype=torch.bool, device=dev)
    follow = torch.zeros(num_reqs, dtype=torch.int64, device=dev)
    for n in range(min(prompt_lookup_max, capacity - 1), prompt_lookup_min - 1, -1):
        suffix_cols = (num_tokens[:, None] - n + torch.arange(n, device=dev)).clamp(min=0)
        suffix = token_ids.gather(1, suffix_cols)  # [num_reqs, n]
        windows = token_ids.unfold(1, n, 1)  # [num_reqs, capacity - n + 1, n]
        starts = torch.arange(windows.shape[1], device=dev)
        hit = (windows == suffix[:, None, :]).all(dim=-1)
        hit &= starts[None, :] < (num_tokens - n)[:, None]
        last = torch.where(hit, starts[None, :], -1).amax(dim=1)  # [num_reqs]
        new = (last >= 0) & ~found & (num_tokens > n)
        follow = torch.where(new, last + n, follow)
        found |= new
    num = torch.where(found, (num_tokens - follow).clamp(0, k), 0)
    cols = torch.arange(k, device=dev)
    drafts = token_ids.gather(1, (follow[:, None] + cols).clamp(max=capacity - 1))
    return torch.where(cols[None, :] < num[:, None], drafts, PAD_TOKEN_ID), num


class NgramSpeculator(BaseSpeculator):
    """Proposes :func:`ngram_lookup`'s drafts, their lengths in
    :attr:`DraftOutput.num_draft_tokens`; the verifier treats them as one-hot.

    Raises (at construction):
        ValueError: ``prompt_lookup_min < 1`` or ``prompt_lookup_min > prompt_lookup_max``.
    """

    needs_token_ids = True  # the lookup is a few tensor operations, run eagerly

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({prompt_lookup_max})")
        self.max_num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min, self.prompt_lookup_max = prompt_lookup_min, prompt_lookup_max

    @torch.no_grad()
    def propose(self, inputs: ProposeInputs) -> DraftOutput | None:
        k = inputs.num_speculative_tokens
        self.check_num_speculative_tokens(k)
        if k == 0:
            return None
        batch = inputs.input_batch
        assert batch.token_ids is not None, "the engine keeps no token history"
        idx = inputs.idx_mapping
        drafts, num = ngram_lookup(batch.token_ids[idx], batch.num_tokens[idx],
                                   self.prompt_lookup_min, self.prompt_lookup_max, k)
        return DraftOutput(drafts, None, num)
