"""Batched logits processing (temperature, top-k, top-p) and sampling.

Each request may carry its own seeded ``torch.Generator``; rows without one draw from
torch's global generator in one batched call. Sampling uses the exponential race
(``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. picks index ``i`` with probability
``p_i``), which needs no cumulative sums and is exact for unnormalised ``p``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specula.runtime.engine.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-request sampling settings of a batch, as tensors."""

    temperature: torch.Tensor
    """[num_reqs] float32; 0 marks a greedy request."""
    top_p: torch.Tensor
    """[num_reqs] float32 in (0, 1]."""
    top_k: torch.Tensor
    """[num_reqs] int64; 0 disables top-k."""
    is_greedy: torch.Tensor
    """[num_reqs] bool."""
    generators: list[torch.Generator | None]
    """Per request; ``None`` rows use the global generator."""
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        device: torch.device,
    ) -> SamplingMetadata:
        temps = [p.temperature for p in params]
        top_k = [max(p.top_k, 0) for p in params]
        top_p = [p.top_p for p in params]
        greedy = [t == 0.0 for t in temps]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            generators=list(generators),
            all_greedy=not random_rows,
            needs_top_k=any(top_k[i] > 0 for i in random_rows),
            needs_top_p=any(top_p[i] < 1.0 for i in random_rows),
        )

    @property
    def num_reqs(self) -> int:
        return self.temperature.shape[0]


def compute_probs(logits: torch.Tensor, sampling: SamplingMetadata) -> torch.Tensor:
    """Turn raw logits into each request's sampling distribution.

    Applies, in this order (as ``transformers`` does): temperature, top-k, top-p. Greedy
    rows are processed with temperature 1 and no truncation; callers take their argmax
    from the raw logits instead.

    Args:
        logits: [num_reqs, num_positions, vocab_size] float32.

    Returns:
        [num_reqs, num_positions, vocab_size] float32 probabilities.
    """
    assert logits.ndim == 3 and logits.shape[0] == sampling.num_reqs
    temp = torch.where(
        sampling.is_greedy, torch.ones_like(sampling.temperature), sampling.temperature
    )
    logits = logits / temp[:, None, None]
    if sampling.needs_top_k or sampling.needs_top_p:
        logits = _apply_top_k_top_p(logits, sampling)
    return logits.softmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, sampling: SamplingMetadata) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [num_reqs, P, V]
    ranks = torch.arange(vocab_size, device=logits.device)
    top_k = torch.where(
        (sampling.top_k > 0) & ~sampling.is_greedy,
        sampling.top_k,
        torch.full_like(sampling.top_k, vocab_size),
    )
    drop = ranks[None, None, :] >= top_k[:, None, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if sampling.needs_top_p:
        top_p = torch.where(sampling.is_greedy, torch.ones_like(sampling.top_p), sampling.top_p)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
        drop = mass_before >= top_p[:, None, None]
        drop[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def random_uniform(
    shape: tuple[int, ...], generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """[num_reqs, *shape] uniform [0, 1) samples; row ``i`` from ``generators[i]`` if set."""
    out = torch.rand((len(generators), *shape), device=device)
    for i, gen in enumerate(generators):
        if gen is not None:
            out[i] = torch.rand(shape, generator=gen, device=device)
    return out


def random_exponential(
    shape: tuple[int, ...], generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """[num_reqs, *shape] Exp(1) samples; row ``i`` from ``generators[i]`` if set."""
    out = torch.empty((len(generators), *shape), device=device).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None:
            out[i].exponential_(generator=gen)
    return out


def sample_from_probs(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """Draw one token per row of ``probs [num_reqs, vocab_size]`` (rows need not sum to 1,
    but each needs a positive entry). Returns [num_reqs] int64."""
    noise = random_exponential((probs.shape[-1],), generators, probs.device)
    return (probs / noise).argmax(dim=-1)


def sample(
    logits: torch.Tensor, sampling: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample one token per request.

    Args:
        logits: [num_reqs, vocab_size] float32 raw logits.

    Returns:
        ``(token_ids [num_reqs] int64, probs [num_reqs, vocab_size] | None)``: greedy rows
        take the argmax; ``probs`` (the distribution each random row sampled from) is
        ``None`` when every request is greedy.
    """
    greedy_ids = logits.argmax(dim=-1)
    if sampling.all_greedy:
        return greedy_ids, None
    probs = compute_probs(logits[:, None, :], sampling)[:, 0]  # [num_reqs, vocab_size]
    random_ids = sample_from_probs(probs, sampling.generators)
    return torch.where(sampling.is_greedy, greedy_ids, random_ids), probs
