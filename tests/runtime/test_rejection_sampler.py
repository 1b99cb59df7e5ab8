"""Rejection sampler: hand-built greedy cases, seeded determinism, and the output
distribution equals the (processed) target distribution."""

from __future__ import annotations

import pytest
import torch

from specula.runtime.engine.sampler import SamplingMetadata, compute_probs
from specula.runtime.engine.sampling_params import SamplingParams
from specula.runtime.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample

pytestmark = pytest.mark.runtime

ALPHA = 0.001
"""Significance level of the goodness-of-fit tests (with fixed seeds the outcome is
deterministic; ALPHA bounds how unlucky a correct sampler could be)."""


def _metadata(params: list[SamplingParams], seeded: bool = False) -> SamplingMetadata:
    gens = [
        torch.Generator().manual_seed(p.seed) if seeded and p.seed is not None else None
        for p in params
    ]
    return SamplingMetadata.from_params(params, gens, torch.device("cpu"))


def _logits_with_argmax(argmax: list[list[int]], vocab: int = 10) -> torch.Tensor:
    """[num_reqs, len, vocab] random logits whose argmax per position is given."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(argmax), len(argmax[0]), vocab, generator=gen)
    for i, row in enumerate(argmax):
        for j, tok in enumerate(row):
            logits[i, j, tok] = logits[i, j].max() + 1.0
    return logits


def test_greedy_all_accepted_emits_bonus_token():
    drafts = torch.tensor([[3, 5, 7]])
    logits = _logits_with_argmax([[3, 5, 7, 9]])
    out, num_accepted = rejection_sample(drafts, None, logits, _metadata([SamplingParams()]))
    assert out.tolist() == [[3, 5, 7, 9]]
    assert num_accepted.tolist() == [3]


def test_greedy_first_mismatch_emits_recovered_token_then_placeholders():
    drafts = torch.tensor([[3, 5, 7], [1, 2, 3], [4, 4, 4]])
    logits = _logits_with_argmax([[3, 6, 7, 9], [0, 2, 3, 1], [4, 4, 4, 8]])
    out, num_accepted = rejection_sample(drafts, None, logits, _metadata([SamplingParams()] * 3))
    p = PLACEHOLDER_TOKEN_ID
    # Row 0: accepts 3, rejects 5 -> recovered 6; later agreement (7) does not count.
    assert out.tolist() == [[3, 6, p, p], [0, p, p, p], [4, 4, 4, 8]]
    assert num_accepted.tolist() == [1, 0, 3]


def test_greedy_k1():
    drafts = torch.tensor([[2], [5]])
    logits = _logits_with_argmax([[2, 7], [4, 1]])
    out, num_accepted = rejection_sample(drafts, None, logits, _metadata([SamplingParams()] * 2))
    assert out.tolist() == [[2, 7], [4, PLACEHOLDER_TOKEN_ID]]
    assert num_accepted.tolist() == [1, 0]


def test_random_rows_require_draft_probs():
    drafts = torch.tensor([[1, 2]])
    logits = torch.randn(1, 3, 10)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(drafts, None, logits, _metadata([SamplingParams(temperature=1.0)]))


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="does not match"):
        rejection_sample(
            torch.tensor([[1, 2]]), None, torch.randn(1, 2, 10), _metadata([SamplingParams()])
        )


def test_mixed_greedy_and_random_rows():
    """A greedy row follows the argmax rule even when batched with sampled rows."""
    vocab = 10
    drafts = torch.tensor([[3, 5], [3, 5]])
    logits = _logits_with_argmax([[3, 5, 2], [3, 5, 2]], vocab)
    draft_probs = torch.full((2, 2, vocab), 1.0 / vocab)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1)]
    out, num_accepted = rejection_sample(
        drafts, draft_probs, logits, _metadata(params, seeded=True)
    )
    assert out[0].tolist() == [3, 5, 2] and num_accepted[0] == 2
    assert 0 <= num_accepted[1] <= 2 and out[1, num_accepted[1]] != PLACEHOLDER_TOKEN_ID


def _random_case(num_reqs: int, k: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(num_reqs, k + 1, vocab, generator=gen) * 2
    draft_probs = torch.softmax(torch.randn(num_reqs, k, vocab, generator=gen) * 2, dim=-1)
    drafts = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(num_reqs, k)
    return drafts, draft_probs, target_logits


def test_seeded_rows_are_deterministic_and_seed_dependent():
    drafts, draft_probs, logits = _random_case(num_reqs=16, k=4, vocab=12, seed=0)
    params = [SamplingParams(temperature=1.0, seed=100 + i) for i in range(16)]
    first = rejection_sample(drafts, draft_probs, logits, _metadata(params, seeded=True))
    torch.rand(1000)  # global RNG state must not matter for seeded rows
    again = rejection_sample(drafts, draft_probs, logits, _metadata(params, seeded=True))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    other = [SamplingParams(temperature=1.0, seed=999 + i) for i in range(16)]
    different = rejection_sample(drafts, draft_probs, logits, _metadata(other, seeded=True))
    assert not torch.equal(first[0], different[0])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
    ids=["t1", "t0.7-topk4", "t1.3-topp0.8"],
)
def test_output_distribution_matches_target(params, chi_square):
    """Every emitted position is distributed as the processed target distribution:
    position 0 over all rows; position 1 over rows that accepted draft token 0 (it is
    then either the accepted draft token 1 or the recovered token of position 1)."""
    torch.manual_seed(1234)
    vocab, k, n = 8, 2, 40_000
    gen = torch.Generator().manual_seed(7)
    one_target = torch.randn(1, k + 1, vocab, generator=gen) * 1.5
    # A draft that is deliberately wrong in places, so both branches are exercised.
    one_draft = torch.softmax(torch.randn(1, k, vocab, generator=gen) * 1.5, dim=-1)
    target_logits = one_target.expand(n, -1, -1).contiguous()
    draft_probs = one_draft.expand(n, -1, -1).contiguous()
    drafts = torch.multinomial(draft_probs.view(-1, vocab), 1).view(n, k)
    sampling = _metadata([params] * n)

    out, num_accepted = rejection_sample(drafts, draft_probs, target_logits, sampling)

    target_probs = compute_probs(one_target, _metadata([params]))[0]  # [k + 1, vocab]
    accepted_first = (num_accepted >= 1).float().mean().item()
    assert 0.05 < accepted_first < 0.95, f"uninformative case: {accepted_first} accept token 0"
    counts0 = torch.bincount(out[:, 0], minlength=vocab)
    assert chi_square(counts0, target_probs[0]) > ALPHA
    second = out[num_accepted >= 1, 1]
    counts1 = torch.bincount(second, minlength=vocab)
    assert chi_square(counts1, target_probs[1]) > ALPHA


def test_bonus_token_distribution(chi_square):
    """When the draft equals the target exactly, all k are accepted and the bonus
    token follows the last target distribution."""
    torch.manual_seed(99)
    vocab, k, n = 6, 2, 20_000
    gen = torch.Generator().manual_seed(3)
    one_target = torch.randn(1, k + 1, vocab, generator=gen)
    params = SamplingParams(temperature=1.0)
    probs = compute_probs(one_target, _metadata([params]))[0]
    draft_probs = probs[:k].expand(n, -1, -1).contiguous()
    drafts = torch.multinomial(draft_probs.view(-1, vocab), 1).view(n, k)
    out, num_accepted = rejection_sample(
        drafts, draft_probs, one_target.expand(n, -1, -1), _metadata([params] * n)
    )
    assert torch.all(num_accepted == k)
    assert chi_square(torch.bincount(out[:, k], minlength=vocab), probs[k]) > ALPHA
