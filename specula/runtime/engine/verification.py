"""Verification of a step's drafts on the device: the rejection sampler (Leviathan et al., arXiv
2211.17192; the kernel of :mod:`specula.runtime.kernels.rejection_sampler`) on the target's logits,
or, for benchmarks, synthetic acceptance (vLLM's ``rejection_sample_method="synthetic"``)."""

from __future__ import annotations

import torch

from specula.runtime.engine.input_batch import InputBatch
from specula.runtime.engine.sampler import (
    STREAM_ACCEPT,
    STREAM_TARGET,
    SamplingMetadata,
    compute_probs,
    random_exponential,
    random_uniform,
)
from specula.runtime.kernels.rejection_sampler import rejection_sample


def verify(input_batch: InputBatch, logits: torch.Tensor | None, idx: torch.Tensor, k: int,
           cu: torch.Tensor, sampling: SamplingMetadata, keys: torch.Tensor,
           synthetic_acceptance_rate: float | None,
           argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify the ``k`` drafts of the requests at rows ``idx`` of ``input_batch``.

    Args:
        logits: [num_reqs * (k + 1), vocab_size] float32 or the model's dtype, the
            target's at each request's last token and drafts; may be ``None`` when
            every request is greedy or ``synthetic_acceptance_rate`` is given.
        idx: [num_reqs] int64 rows.
        cu: [num_reqs] int32 ``k, 2k, ...``, the inclusive cumulative draft counts.
        sampling: the requests' settings (greedy ones match the argmax exactly).
        keys: [num_reqs] int64 draw keys of the step.
        synthetic_acceptance_rate: as :class:`~.llm_engine.LLMEngine` takes it; ``None``: verify.
        argmax: [num_reqs * (k + 1)] int64 ``logits.argmax(-1)``.

    Returns:
        ``(output [num_reqs, k + 1] int64, num_accepted [num_reqs] int64)``, as
        :func:`~specula.runtime.kernels.rejection_sampler.rejection_sample` returns them.
    """
    drafts = input_batch.draft_token_ids[idx, :k].reshape(-1)  # [num_reqs * k]
    rate = synthetic_acceptance_rate  # synthetic: each accepted given the ones before it
    greedy = sampling.all_greedy and rate is None
    u = None if greedy else random_uniform(sampling.seeds, keys, STREAM_ACCEPT, k).view(-1)
    if sampling.all_greedy or rate is not None:
        return rejection_sample(drafts, cu, argmax, k, uniform_samples=u,
                                synthetic_acceptance_rate=rate)
    vocab = logits.shape[-1]
    probs = compute_probs(logits.view(-1, k + 1, vocab), sampling).view(-1, vocab)
    kept = input_batch.draft_probs
    draft_probs = None if kept is None else kept[idx, :k].reshape(-1, vocab)
    return rejection_sample(
        drafts, cu, argmax, k, is_greedy=sampling.is_greedy, draft_probs=draft_probs,
        target_probs=probs, uniform_samples=u,
        exponential_noise=random_exponential(sampling.seeds, keys, STREAM_TARGET, vocab))
