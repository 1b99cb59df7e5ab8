"""Batched logits processing (temperature, top-k, top-p), sampling, and the random numbers
both draw from, all as device tensor operations (no host loop, CUDA-graph safe).

Randomness is counter-based (the idea of Philox, Salmon et al., SC 2011, with a
32-bit integer hash as the round function): every draw is a pure function of the
request's seed, a *key* that is unique per request and step, a *stream* id that keeps
different uses apart, and a column index. A request's output then depends only on its
own seed, prompt and speculation settings, never on the batch it runs in, and there is
no ``torch.Generator`` per request to loop over. Keys are the position of the first
token a step can emit for the request (strictly increasing from step to step, preemption
included), so no draw is ever reused (a reused uniform would bias rejection sampling).

Sampling uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. picks
index ``i`` with probability ``p_i``), which needs no cumulative sums and is exact for
unnormalised ``p``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specula.runtime.engine.sampling_params import SamplingParams

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1

STREAM_TARGET = 0
"""Draws of the target's own samples (prefill, plain decode, recovered and bonus tokens)."""
STREAM_ACCEPT = 1
"""The uniform draw of each draft token's accept test."""
STREAM_DRAFT = 2
"""Draws of a probabilistic draft (``+ step`` for its ``step``-th token)."""


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for 0 <= x < 2**32 without int64 overflow: 16-bit halves.
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (``lowbias32``, C. Wellons, 2018), on
    int64 tensors holding values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def random_bits(
    seeds: torch.Tensor, keys: torch.Tensor, stream: int, num_cols: int
) -> torch.Tensor:
    """``[num_reqs, num_cols]`` int64 hashes in ``[0, 2**32)``, a pure function of
    ``(seeds[i], keys[i], stream, column)``.

    Args:
        seeds: [num_reqs] int64 (any value; both 32-bit halves are mixed in).
        keys: [num_reqs] int64 in ``[0, 2**32)``.
        stream: a small non-negative int separating independent uses.
    """
    row = _mix32((seeds & _M32) ^ _mix32(torch.full_like(seeds, stream & _M32)))
    row = _mix32(row ^ ((seeds >> 32) & _M32))
    row = _mix32(row ^ (keys & _M32))  # [num_reqs]
    cols = torch.arange(num_cols, device=seeds.device, dtype=torch.int64)
    return _mix32(row[:, None] ^ _mul32(cols, _GOLDEN)[None, :])


def random_uniform(
    seeds: torch.Tensor, keys: torch.Tensor, stream: int, num_cols: int
) -> torch.Tensor:
    """``[num_reqs, num_cols]`` float32 uniforms in ``[0, 1)`` (24-bit resolution)."""
    return (random_bits(seeds, keys, stream, num_cols) >> 8).float() * (1.0 / (1 << 24))


def random_exponential(
    seeds: torch.Tensor, keys: torch.Tensor, stream: int, num_cols: int
) -> torch.Tensor:
    """``[num_reqs, num_cols]`` float32 ``Exp(1)`` draws, all positive (the uniforms are
    taken at bin centres, so none is 0 or 1)."""
    bits = random_bits(seeds, keys, stream, num_cols) >> 8
    return -torch.log((bits.float() + 0.5) * (1.0 / (1 << 24)))


@dataclass
class SamplingMetadata:
    """Per-request sampling settings of a batch, as device tensors, with host flags that
    let all-greedy batches skip the probability work."""

    temperature: torch.Tensor
    """[num_reqs] float32; 0 marks a greedy request."""
    top_p: torch.Tensor
    """[num_reqs] float32 in (0, 1]."""
    top_k: torch.Tensor
    """[num_reqs] int64; 0 disables top-k."""
    seeds: torch.Tensor
    """[num_reqs] int64."""
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool

    @property
    def is_greedy(self) -> torch.Tensor:
        """[num_reqs] bool."""
        return self.temperature == 0.0

    @property
    def num_reqs(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], seeds: Sequence[int], device: torch.device
    ) -> SamplingMetadata:
        """Build the tensors from the host (tests and references; the engine gathers
        them from its persistent per-request state instead)."""
        return cls(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], device=device),
            seeds=torch.tensor(list(seeds), dtype=torch.int64, device=device),
            **flags_of(params),
        )

    def select(self, rows: slice) -> SamplingMetadata:
        """The metadata of a contiguous range of requests (the flags stay conservative)."""
        return SamplingMetadata(
            self.temperature[rows], self.top_p[rows], self.top_k[rows], self.seeds[rows],
            self.all_greedy, self.needs_top_k, self.needs_top_p,
        )


def flags_of(params: Sequence[SamplingParams]) -> dict[str, bool]:
    """``all_greedy``, ``needs_top_k``, ``needs_top_p`` of a batch."""
    random_rows = [p for p in params if p.temperature > 0.0]
    return {
        "all_greedy": not random_rows,
        "needs_top_k": any(p.top_k > 0 for p in random_rows),
        "needs_top_p": any(p.top_p < 1.0 for p in random_rows),
    }


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
    greedy = sampling.is_greedy
    temp = torch.where(greedy, torch.ones_like(sampling.temperature), sampling.temperature)
    logits = logits / temp[:, None, None]
    if sampling.needs_top_k or sampling.needs_top_p:
        logits = _apply_top_k_top_p(logits, sampling, greedy)
    return logits.softmax(dim=-1)


def _apply_top_k_top_p(
    logits: torch.Tensor, sampling: SamplingMetadata, greedy: torch.Tensor
) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [num_reqs, P, V]
    ranks = torch.arange(vocab_size, device=logits.device)
    top_k = torch.where(
        (sampling.top_k > 0) & ~greedy,
        sampling.top_k,
        torch.full_like(sampling.top_k, vocab_size),
    )
    drop = ranks[None, None, :] >= top_k[:, None, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if sampling.needs_top_p:
        top_p = torch.where(greedy, torch.ones_like(sampling.top_p), sampling.top_p)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
        drop = mass_before >= top_p[:, None, None]
        drop[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor, sampling: SamplingMetadata, keys: torch.Tensor, stream: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample one token per request.

    Args:
        logits: [num_reqs, vocab_size] float32 raw logits.
        keys: [num_reqs] int64 draw keys (see the module docstring).
        stream: the draw stream (:data:`STREAM_TARGET`, :data:`STREAM_DRAFT` + step).

    Returns:
        ``(token_ids [num_reqs] int64, probs [num_reqs, vocab_size] | None)``: greedy rows
        take the argmax; ``probs`` (the distribution each random row sampled from) is
        ``None`` when every request is greedy.
    """
    greedy_ids = logits.argmax(dim=-1)
    if sampling.all_greedy:
        return greedy_ids, None
    probs = compute_probs(logits[:, None, :], sampling)[:, 0]  # [num_reqs, vocab_size]
    noise = random_exponential(sampling.seeds, keys, stream, probs.shape[-1])
    random_ids = (probs / noise).argmax(dim=-1)
    return torch.where(sampling.is_greedy, greedy_ids, random_ids), probs
