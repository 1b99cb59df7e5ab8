"""Batched logits processing (temperature, top-k, top-p), sampling, and the random numbers
both draw from, all as device tensor operations (no host loop, CUDA-graph safe).

Randomness is counter-based (:mod:`specula.runtime.kernels.random`, one kernel per
draw): every draw is a pure function of the request's seed, a *key* unique per request
and step, a *stream* id that keeps different uses apart, and a column index. A request's
output then depends only on its own seed, prompt and speculation settings, never on its
batch, with no ``torch.Generator`` per request to loop over. Keys are the position of
the first token a step can emit for the request (strictly increasing from step to step,
preemption included), so no draw is ever reused (which would bias rejection sampling).

Sampling uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. picks index ``i``
with probability ``p_i``), which needs no cumulative sums and is exact for unnormalised ``p``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specula.runtime.engine.sampling_params import SamplingParams
from specula.runtime.kernels.random import MODE_EXPONENTIAL, MODE_UNIFORM, random_draws

STREAM_TARGET = 0
"""Draws of the target's own samples (prefill, plain decode, recovered and bonus tokens)."""
STREAM_ACCEPT = 1
"""The uniform draw of each draft token's accept test."""
STREAM_DRAFT = 2
"""Draws of a probabilistic draft (``+ step`` for its ``step``-th token)."""


def random_uniform(seeds: torch.Tensor, keys: torch.Tensor, stream: int,
                   num_cols: int) -> torch.Tensor:
    """``[num_reqs, num_cols]`` float32 uniforms in ``[0, 1)`` (24-bit resolution)."""
    return random_draws(seeds.contiguous(), keys.contiguous(), stream, num_cols, MODE_UNIFORM)


def random_exponential(seeds: torch.Tensor, keys: torch.Tensor, stream: int,
                       num_cols: int) -> torch.Tensor:
    """``[num_reqs, num_cols]`` float32 ``Exp(1)`` draws, all positive (the uniforms are
    taken at bin centres, so none is 0 or 1)."""
    return random_draws(seeds.contiguous(), keys.contiguous(), stream, num_cols, MODE_EXPONENTIAL)


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

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], seeds: Sequence[int],
                    device: torch.device) -> SamplingMetadata:
        """Build the tensors from the host (tests and references; the engine gathers
        them from :class:`~specula.runtime.engine.input_batch.InputBatch`)."""
        return cls(temperature=torch.tensor([p.temperature for p in params], device=device),
                   top_p=torch.tensor([p.top_p for p in params], device=device),
                   top_k=torch.tensor([max(p.top_k, 0) for p in params], device=device),
                   seeds=torch.tensor(list(seeds), dtype=torch.int64, device=device),
                   **flags_of(params))

    def select(self, rows: slice | torch.Tensor) -> SamplingMetadata:
        """The metadata of a range or int64 index tensor of requests (flags stay conservative)."""
        return SamplingMetadata(self.temperature[rows], self.top_p[rows], self.top_k[rows],
                                self.seeds[rows], self.all_greedy, self.needs_top_k,
                                self.needs_top_p)


def flags_of(params: Sequence[SamplingParams]) -> dict[str, bool]:
    """``all_greedy``, ``needs_top_k``, ``needs_top_p`` of a batch."""
    random_rows = [p for p in params if p.temperature > 0.0]
    return {"all_greedy": not random_rows, "needs_top_k": any(p.top_k > 0 for p in random_rows),
            "needs_top_p": any(p.top_p < 1.0 for p in random_rows)}


def process_logits(logits: torch.Tensor, sampling: SamplingMetadata) -> torch.Tensor:
    """Apply each request's temperature, top-k and top-p, in this order (as
    ``transformers`` does); truncated tokens get ``-inf``. Greedy rows are processed
    with temperature 1 and no truncation (their raw logits).

    Args:
        logits: [num_reqs, num_positions, vocab_size], float32 or the model's dtype
            (computed in float32).

    Returns:
        [num_reqs, num_positions, vocab_size] float32 processed logits.
    """
    assert logits.ndim == 3 and logits.shape[0] == sampling.temperature.shape[0]
    greedy = sampling.is_greedy
    temp = torch.where(greedy, torch.ones_like(sampling.temperature), sampling.temperature)
    logits = logits.float() / temp[:, None, None]
    if not (sampling.needs_top_k or sampling.needs_top_p):
        return logits
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [num_reqs, P, V]
    ranks = torch.arange(vocab_size, device=logits.device)
    top_k = torch.where((sampling.top_k > 0) & ~greedy, sampling.top_k, vocab_size)
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


def compute_probs(logits: torch.Tensor, sampling: SamplingMetadata) -> torch.Tensor:
    """The softmax of :func:`process_logits`: [num_reqs, num_positions, vocab_size] float32
    (callers take greedy rows' argmax from the raw logits instead)."""
    return process_logits(logits, sampling).softmax(dim=-1)


def token_logprobs(logits: torch.Tensor, sampling: SamplingMetadata, token_ids: torch.Tensor,
                   num_top: int) -> torch.Tensor:
    """Log-probabilities of ``token_ids`` and the ``num_top`` most likely tokens under
    each request's processed distribution (the log-softmax of :func:`process_logits`:
    vLLM's ``logprobs_mode="processed_logprobs"``; greedy rows: of the raw logits).

    Args:
        logits: [num_reqs, num_positions, vocab_size].
        token_ids: [num_reqs, num_positions] int64; negative ids (placeholders) give
            the log-probability of token 0, which callers drop.

    Returns:
        [num_reqs, num_positions, 1 + 2 * num_top] float32: the token's log-probability,
        the top log-probabilities (descending), then their token ids as floats (exact
        below 2**24, far above any vocabulary).
    """
    logprobs = process_logits(logits, sampling).log_softmax(dim=-1)
    chosen = logprobs.gather(-1, token_ids.clamp(min=0)[..., None])
    if num_top == 0:
        return chosen
    top = logprobs.topk(num_top, dim=-1)
    return torch.cat([chosen, top.values, top.indices.float()], dim=-1)


def sample(logits: torch.Tensor, sampling: SamplingMetadata, keys: torch.Tensor, stream: int,
           argmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample one token per request.

    Args:
        logits: [num_reqs, vocab_size] raw logits, float32 or the model's dtype.
        keys: [num_reqs] int64 draw keys (see the module docstring).
        stream: the draw stream (:data:`STREAM_TARGET`, :data:`STREAM_DRAFT` + step).
        argmax: [num_reqs] int64 ``logits.argmax(-1)`` when the caller has it (the LM
            head's fused argmax); computed here otherwise.

    Returns:
        ``(token_ids [num_reqs] int64, probs [num_reqs, vocab_size] | None)``: greedy rows
        take the argmax; ``probs`` (the distribution each random row sampled from) is
        ``None`` when every request is greedy.
    """
    greedy_ids = logits.argmax(dim=-1) if argmax is None else argmax
    if sampling.all_greedy:
        return greedy_ids, None
    probs = compute_probs(logits[:, None, :], sampling)[:, 0]  # [num_reqs, vocab_size]
    noise = random_exponential(sampling.seeds, keys, stream, probs.shape[-1])
    random_ids = (probs / noise).argmax(dim=-1)
    return torch.where(sampling.is_greedy, greedy_ids, random_ids), probs
