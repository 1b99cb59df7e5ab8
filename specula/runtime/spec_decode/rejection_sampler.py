"""Verification of draft tokens: the rejection sampler of speculative sampling.

Leviathan et al., "Fast Inference from Transformers via Speculative Decoding"
(arXiv 2211.17192), and Chen et al., "Accelerating Large Language Model Decoding with
Speculative Sampling" (arXiv 2302.01318). For draft token ``x_i`` drawn from the draft
distribution ``q_i`` and target distribution ``p_i``:

- accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``;
- at the first rejection, emit a *recovered token* drawn from
  ``norm(max(0, p_i - q_i))`` and stop;
- if all ``k`` are accepted, emit a *bonus token* drawn from ``p_{k+1}``.

The emitted tokens are distributed exactly as if sampled from the target one by one.
Greedy requests accept while the draft token equals the target argmax, then emit the
target argmax. ``p`` is the *processed* target distribution (temperature, top-k, top-p of
the request), the same processing the draft sampled under.

Output layout follows vLLM (``vllm/v1/sample/rejection_sampler.py``): ``[num_reqs, k + 1]``
padded with :data:`PLACEHOLDER_TOKEN_ID`.
"""

from __future__ import annotations

import torch

from specula.runtime.engine.sampler import (
    SamplingMetadata,
    compute_probs,
    random_uniform,
    sample_from_probs,
)

PLACEHOLDER_TOKEN_ID = -1
"""Fills output positions after the first rejection (vLLM convention)."""


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    sampling: SamplingMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify ``k`` draft tokens per request against one target forward.

    Args:
        draft_token_ids: [num_reqs, k] int64.
        draft_probs: [num_reqs, k, vocab_size] float32, the distributions the draft tokens
            were sampled from (rows of greedy requests are ignored); ``None`` when every
            request is greedy.
        target_logits: [num_reqs, k + 1, vocab_size] float32 raw target logits at the
            positions that predict draft token 1..k and the bonus token.
        sampling: per-request settings and generators. Per row, the random draws are
            ``k`` uniforms then one exponential vector, from that row's generator.

    Returns:
        ``(output_token_ids [num_reqs, k + 1] int64, num_accepted [num_reqs] int64)``:
        row ``i`` holds ``num_accepted[i]`` accepted draft tokens, then one recovered or
        bonus token, then :data:`PLACEHOLDER_TOKEN_ID`.

    Raises:
        ValueError: shapes disagree, or ``draft_probs`` is ``None`` while some request
            samples (temperature > 0).
    """
    if draft_token_ids.ndim != 2 or target_logits.ndim != 3:
        raise ValueError("draft_token_ids must be [num_reqs, k], target_logits [num_reqs, k+1, V]")
    num_reqs, k = draft_token_ids.shape
    if target_logits.shape[:2] != (num_reqs, k + 1):
        raise ValueError(
            f"target_logits shape {tuple(target_logits.shape)} does not match "
            f"draft_token_ids {tuple(draft_token_ids.shape)}"
        )
    device = target_logits.device
    rows = torch.arange(num_reqs, device=device)
    positions = torch.arange(k + 1, device=device)

    target_argmax = target_logits.argmax(dim=-1)  # [num_reqs, k + 1]
    matches = draft_token_ids == target_argmax[:, :k]
    num_accepted = matches.long().cumprod(dim=-1).sum(dim=-1)  # [num_reqs]
    final_token = target_argmax[rows, num_accepted]  # [num_reqs]

    if not sampling.all_greedy:
        if draft_probs is None:
            raise ValueError("draft_probs is required when a request samples (temperature > 0)")
        if draft_probs.shape != (num_reqs, k, target_logits.shape[-1]):
            raise ValueError(
                f"draft_probs shape {tuple(draft_probs.shape)} != "
                f"({num_reqs}, {k}, {target_logits.shape[-1]})"
            )
        rand_accepted, rand_final = _random_verify(
            draft_token_ids, draft_probs, compute_probs(target_logits, sampling), sampling
        )
        num_accepted = torch.where(sampling.is_greedy, num_accepted, rand_accepted)
        final_token = torch.where(sampling.is_greedy, final_token, rand_final)

    padded_drafts = torch.cat(
        [draft_token_ids, draft_token_ids.new_full((num_reqs, 1), PLACEHOLDER_TOKEN_ID)], dim=1
    )
    output = torch.where(
        positions[None, :] < num_accepted[:, None], padded_drafts, PLACEHOLDER_TOKEN_ID
    )  # [num_reqs, k + 1]
    output[rows, num_accepted] = final_token
    return output, num_accepted


def _random_verify(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    sampling: SamplingMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    # draft_token_ids [R, k]; draft_probs [R, k, V]; target_probs [R, k + 1, V]
    num_reqs, k = draft_token_ids.shape
    rows = torch.arange(num_reqs, device=target_probs.device)
    index = draft_token_ids[..., None]
    p = target_probs[:, :k].gather(-1, index).squeeze(-1)  # [R, k]
    q = draft_probs.gather(-1, index).squeeze(-1)  # [R, k]
    u = random_uniform((k,), sampling.generators, target_probs.device)  # [R, k]
    # u < p / q, rewritten to avoid dividing by q.
    accepted = u * q < p
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [R]

    # Position num_accepted's residual max(0, p - q); at position k there is no draft
    # distribution (q = 0), so the same formula yields p_{k+1} for the bonus token.
    q_padded = torch.cat(
        [draft_probs, draft_probs.new_zeros(num_reqs, 1, draft_probs.shape[-1])], 1
    )
    p_sel = target_probs[rows, num_accepted]  # [R, V]
    residual = (p_sel - q_padded[rows, num_accepted]).clamp_min(0)
    # The residual vanishes only when p == q, where rejection has probability 0; guard
    # against rounding anyway.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p_sel, residual)
    return num_accepted, sample_from_probs(residual, sampling.generators)
