"""Rejection sampler (:func:`specula.runtime.kernels.rejection_sampler.rejection_sample`,
which runs its torch reference on CPU tensors): hand-built greedy cases, one-hot
treatment of drafts without probabilities, shape checks, mixed batches, determinism
given the counter-based draws, and the output distribution equals the (processed)
target distribution.

Random draws are made as the engine's ``LLMEngine._verify`` makes them: per request, the
accept uniforms from :data:`STREAM_ACCEPT` and the exponential noise of the recovered or
bonus token from :data:`STREAM_TARGET`, both functions of the request's seed and a key.
"""

from __future__ import annotations

import pytest
import torch

from specula.runtime.engine.sampler import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_TARGET,
    SamplingMetadata,
    compute_probs,
    random_exponential,
    random_uniform,
)
from specula.runtime.engine.sampling_params import SamplingParams
from specula.runtime.kernels.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample

pytestmark = pytest.mark.runtime

ALPHA = 0.001
"""Significance level of the goodness-of-fit tests (with fixed seeds the outcome is
deterministic; ALPHA bounds how unlucky a correct sampler could be)."""

CPU = torch.device("cpu")
P = PLACEHOLDER_TOKEN_ID
KEY = 7
"""Draw key of the tests' verification steps (the engine uses a position)."""


def _cu(num_draft: list[int]) -> torch.Tensor:
    return torch.tensor(num_draft).cumsum(0).to(torch.int32)


def _metadata(params: list[SamplingParams], seeds: list[int] | None = None) -> SamplingMetadata:
    return SamplingMetadata.from_params(params, seeds or [0] * len(params), CPU)


def _draws(seeds: torch.Tensor, k: int, vocab: int, key: int = KEY):
    """``(uniform_samples [num_reqs * k], exponential_noise [num_reqs, vocab])`` of
    requests with ``seeds`` at draw key ``key``, as the engine draws them."""
    keys = torch.full_like(seeds, key)
    uniform = random_uniform(seeds, keys, STREAM_ACCEPT, k).reshape(-1)
    return uniform, random_exponential(seeds, keys, STREAM_TARGET, vocab)


def _verify(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    key: int = KEY,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify ``drafts [num_reqs, k]`` (sampled from ``draft_probs [num_reqs, k, V]``, or
    deterministic when ``None``) against raw target ``logits [num_reqs, k + 1, V]``, the
    way ``LLMEngine._verify`` does."""
    num_reqs, k = drafts.shape
    vocab = logits.shape[-1]
    sampling = _metadata(params, seeds)
    cu = _cu([k] * num_reqs)
    argmax = logits.argmax(-1).reshape(-1)
    if sampling.all_greedy:
        return rejection_sample(drafts.reshape(-1), cu, argmax, k)
    uniform, noise = _draws(sampling.seeds, k, vocab, key)
    return rejection_sample(
        drafts.reshape(-1),
        cu,
        argmax,
        k,
        is_greedy=sampling.is_greedy,
        draft_probs=None if draft_probs is None else draft_probs.reshape(-1, vocab),
        target_probs=compute_probs(logits, sampling).reshape(-1, vocab),
        uniform_samples=uniform,
        exponential_noise=noise,
    )


def _sample_drafts(draft_probs: torch.Tensor, seeds: torch.Tensor, key: int = KEY) -> torch.Tensor:
    """Draft tokens ``[num_reqs, k]`` sampled from ``draft_probs [num_reqs, k, V]`` by the
    exponential race on the draft streams (as a probabilistic draft samples)."""
    num_reqs, k, vocab = draft_probs.shape
    keys = torch.full_like(seeds, key)
    cols = [
        (draft_probs[:, j] / random_exponential(seeds, keys, STREAM_DRAFT + j, vocab)).argmax(-1)
        for j in range(k)
    ]
    return torch.stack(cols, dim=1)


# -- greedy ------------------------------------------------------------------------------


def _greedy_both_paths(drafts: list[list[int]], argmax: list[list[int]], vocab: int = 10):
    """Verify greedy requests (``drafts`` per request, ``argmax`` of its n + 1 target
    rows) through the all-greedy launch and through the general one (every request
    marked greedy, with random probabilities, uniforms and noise, which greedy requests
    must ignore); checks both agree and returns the result."""
    flat_drafts = torch.tensor([t for d in drafts for t in d], dtype=torch.int64)
    flat_argmax = torch.tensor([t for a in argmax for t in a], dtype=torch.int64)
    cu = _cu([len(d) for d in drafts])
    k = max(len(d) for d in drafts)
    out, num_accepted = rejection_sample(flat_drafts, cu, flat_argmax, k)
    gen = torch.Generator().manual_seed(0)
    num_reqs, total = len(drafts), flat_drafts.shape[0]
    general = rejection_sample(
        flat_drafts,
        cu,
        flat_argmax,
        k,
        is_greedy=torch.ones(num_reqs, dtype=torch.bool),
        draft_probs=torch.rand(total, vocab, generator=gen).softmax(-1),
        target_probs=torch.rand(total + num_reqs, vocab, generator=gen).softmax(-1),
        uniform_samples=torch.rand(total, generator=gen),
        exponential_noise=torch.empty(num_reqs, vocab).exponential_(generator=gen),
    )
    assert torch.equal(general[0], out) and torch.equal(general[1], num_accepted)
    return out.tolist(), num_accepted.tolist()


def test_greedy_all_accepted_emits_bonus_token():
    assert _greedy_both_paths([[3, 5, 7]], [[3, 5, 7, 9]]) == ([[3, 5, 7, 9]], [3])


def test_greedy_first_mismatch_emits_recovered_token_then_placeholders():
    out, num_accepted = _greedy_both_paths(
        [[3, 5, 7], [1, 2, 3], [4, 4, 4], []], [[3, 6, 7, 9], [0, 2, 3, 1], [4, 4, 4, 8], [5]]
    )
    # Row 0: accepts 3, rejects 5 -> recovered 6; later agreement (7) does not count.
    # Row 3 drafted nothing (it just prefilled): its target argmax alone.
    assert out == [[3, 6, P, P], [0, P, P, P], [4, 4, 4, 8], [5, P, P, P]]
    assert num_accepted == [1, 0, 3, 0]


def test_greedy_k1():
    out, num_accepted = _greedy_both_paths([[2], [5]], [[2, 7], [4, 1]])
    assert out == [[2, 7], [4, P]]
    assert num_accepted == [1, 0]


def test_placeholder_is_no_token_id():
    assert PLACEHOLDER_TOKEN_ID == -1  # vLLM's value; never a vocabulary id


# -- drafts without probabilities ---------------------------------------------------------


def test_random_rows_without_draft_probs_treat_drafts_as_one_hot():
    """``draft_probs=None`` (n-gram drafts) means ``q`` is one-hot on the draft token:
    accept ``x`` iff ``u < p(x)``, and on rejection the recovered token comes from
    ``max(p - onehot(x), 0)``, which excludes ``x``. Here ``p(x) = 0.5`` with the rest
    on token 4, so acceptance follows the uniform exactly and every rejection recovers 4;
    the bonus row puts all mass on token 2."""
    n, vocab = 400, 6
    seeds = torch.arange(n)
    p = torch.zeros(2, vocab)
    p[0, 1] = p[0, 4] = 0.5
    p[1, 2] = 1.0
    uniform, noise = _draws(seeds, 1, vocab)
    out, num_accepted = rejection_sample(
        torch.ones(n, dtype=torch.int64),
        _cu([1] * n),
        p.argmax(-1).repeat(n),
        1,
        is_greedy=torch.zeros(n, dtype=torch.bool),
        draft_probs=None,
        target_probs=p.repeat(n, 1),
        uniform_samples=uniform,
        exponential_noise=noise,
    )
    expected_accept = uniform < 0.5
    assert 0.3 < expected_accept.float().mean() < 0.7
    assert torch.equal(num_accepted, expected_accept.long())
    assert torch.equal(out[:, 0], torch.where(expected_accept, 1, 4))
    assert torch.equal(out[:, 1], torch.where(expected_accept, 2, P))


def test_no_draft_probs_equals_explicit_one_hot():
    """On a random batch (drafts of different lengths, none for one request), passing no
    draft probabilities gives exactly what one-hot draft probabilities give."""
    num_draft, vocab = [3, 0, 1, 3, 2, 3], 9
    gen = torch.Generator().manual_seed(4)
    num_reqs, total = len(num_draft), sum(num_draft)
    target_probs = (torch.randn(total + num_reqs, vocab, generator=gen) * 2).softmax(-1)
    drafts = torch.randint(0, vocab, (total,), generator=gen)
    seeds = torch.arange(num_reqs) + 50
    keys = torch.full_like(seeds, KEY)
    noise = random_exponential(seeds, keys, STREAM_TARGET, vocab)
    uniform = torch.cat(
        [
            random_uniform(seeds[i : i + 1], keys[:1], STREAM_ACCEPT, n)[0]
            for i, n in enumerate(num_draft)
        ]
    )
    args = (drafts, _cu(num_draft), target_probs.argmax(-1), max(num_draft))
    kw = dict(
        is_greedy=torch.zeros(num_reqs, dtype=torch.bool),
        target_probs=target_probs,
        uniform_samples=uniform,
        exponential_noise=noise,
    )
    out, num_accepted = rejection_sample(*args, draft_probs=None, **kw)
    one_hot = torch.nn.functional.one_hot(drafts, vocab).float()
    ref_out, ref_accepted = rejection_sample(*args, draft_probs=one_hot, **kw)
    assert torch.equal(out, ref_out) and torch.equal(num_accepted, ref_accepted)
    # Informative: some requests accept some drafts, some reject their first.
    assert num_accepted.sum() > 0
    assert any(a < n for a, n in zip(num_accepted.tolist(), num_draft, strict=True))


# -- argument checks ------------------------------------------------------------------------


def _valid_args(num_reqs: int = 2, k: int = 2, vocab: int = 5) -> dict:
    total = num_reqs * k
    return dict(
        draft_token_ids=torch.zeros(total, dtype=torch.int64),
        cu_num_draft_tokens=_cu([k] * num_reqs),
        target_argmax=torch.zeros(total + num_reqs, dtype=torch.int64),
        max_spec_len=k,
        is_greedy=torch.zeros(num_reqs, dtype=torch.bool),
        draft_probs=torch.full((total, vocab), 1.0 / vocab),
        target_probs=torch.full((total + num_reqs, vocab), 1.0 / vocab),
        uniform_samples=torch.full((total,), 0.5),
        exponential_noise=torch.ones(num_reqs, vocab),
    )


@pytest.mark.parametrize(
    "change",
    [
        # The removed sampler's layout: [num_reqs, k] drafts.
        {"draft_token_ids": torch.zeros(2, 2, dtype=torch.int64)},
        {"cu_num_draft_tokens": torch.tensor([2, 4])},  # int64
        {"target_argmax": torch.zeros(4, dtype=torch.int64)},  # no bonus rows
        {"max_spec_len": 0},
        {"is_greedy": torch.zeros(3, dtype=torch.bool)},
        {"draft_probs": torch.full((4, 6), 1.0 / 6)},  # vocabulary differs
        {"target_probs": torch.full((4, 5), 0.2)},  # no bonus rows
        {"target_probs": torch.full((6, 5), 0.2, dtype=torch.float64)},
        {"uniform_samples": torch.full((2,), 0.5)},  # one per request, not per draft
        {"exponential_noise": torch.ones(2, 6)},
        {"exponential_noise": None},
    ],
    ids=[
        "2d-drafts",
        "cu-int64",
        "argmax-rows",
        "max-spec-len-0",
        "is-greedy-len",
        "draft-probs-vocab",
        "target-probs-rows",
        "target-probs-float64",
        "uniform-len",
        "noise-vocab",
        "noise-missing",
    ],
)
def test_shape_mismatch_is_rejected(change):
    args = _valid_args()
    rejection_sample(**args)  # the unchanged arguments are accepted
    args.update(change)
    with pytest.raises(AssertionError):
        rejection_sample(**args)


# -- mixed batches and determinism ------------------------------------------------------------


def test_mixed_greedy_and_random_rows():
    """Greedy rows follow the argmax rule even when batched with sampled rows (on
    inputs where the probabilistic rule would reject often), and sampled rows get the
    result they get alone: each request reads only its own rows, uniforms and noise."""
    vocab, k, n = 10, 2, 32
    logits = torch.zeros(1, k + 1, vocab)
    logits[0, torch.arange(k + 1), torch.tensor([3, 5, 2])] = 1.0  # argmax 3, 5, 2; p ~ 0.23
    draft_probs = torch.zeros(1, k, vocab)
    draft_probs[0, 0, 3] = draft_probs[0, 1, 5] = 1.0  # q = 1 on the drafts: u < p to accept
    drafts = torch.tensor([[3, 5]])
    # Alternate greedy and sampled requests.
    params = [SamplingParams() if i % 2 == 0 else SamplingParams(temperature=1.0) for i in range(n)]
    seeds = list(range(100, 100 + n))
    args = (drafts.expand(n, -1), draft_probs.expand(n, -1, -1), logits.expand(n, -1, -1))
    out, num_accepted = _verify(*args, params, seeds)
    assert torch.all(out[0::2] == torch.tensor([3, 5, 2])) and torch.all(num_accepted[0::2] == k)

    sampled = slice(1, None, 2)
    alone = _verify(*(a[sampled] for a in args), params[sampled], seeds[sampled])
    assert torch.equal(out[sampled], alone[0]) and torch.equal(num_accepted[sampled], alone[1])
    # The sampled requests really used the probabilistic rule (accept draft 0 iff u < 0.23):
    # some, not all, reject it.
    assert 0 < int((num_accepted[sampled] == 0).sum()) < n // 2
    # Row layout: accepted drafts, one token, placeholders.
    for row, a in zip(out[sampled].tolist(), num_accepted[sampled].tolist(), strict=True):
        assert row[:a] == [3, 5][:a] and 0 <= row[a] < vocab and row[a + 1 :] == [P] * (k - a)


def _random_case(num_reqs: int, k: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(num_reqs, k + 1, vocab, generator=gen) * 2
    draft_probs = torch.softmax(torch.randn(num_reqs, k, vocab, generator=gen) * 2, dim=-1)
    drafts = _sample_drafts(draft_probs, torch.arange(num_reqs) + seed)
    return drafts, draft_probs, target_logits


def test_seeded_rows_are_deterministic_and_seed_dependent():
    """The result is a function of the seeds and the key: the same ones give the same
    result (whatever the global generator does), other seeds or another key another."""
    num_reqs = 16
    drafts, draft_probs, logits = _random_case(num_reqs=num_reqs, k=4, vocab=12, seed=0)
    params = [SamplingParams(temperature=1.0, seed=100 + i) for i in range(num_reqs)]
    seeds = [100 + i for i in range(num_reqs)]
    first = _verify(drafts, draft_probs, logits, params, seeds)
    torch.rand(1000)  # the global RNG state must not matter
    again = _verify(drafts, draft_probs, logits, params, seeds)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    other_seeds = _verify(drafts, draft_probs, logits, params, [999 + i for i in range(num_reqs)])
    assert not torch.equal(first[0], other_seeds[0])
    other_key = _verify(drafts, draft_probs, logits, params, seeds, key=KEY + 1)
    assert not torch.equal(first[0], other_key[0])


def test_acceptance_reads_the_uniforms_and_tokens_read_the_noise():
    """With the draws passed in, the accepted counts depend on the uniforms only, and
    the recovered or bonus tokens on the noise."""
    num_reqs, k, vocab = 24, 3, 12
    drafts, draft_probs, logits = _random_case(num_reqs=num_reqs, k=k, vocab=vocab, seed=1)
    params = [SamplingParams(temperature=1.0)] * num_reqs
    sampling = _metadata(params, list(range(num_reqs)))
    base = dict(
        draft_token_ids=drafts.reshape(-1),
        cu_num_draft_tokens=_cu([k] * num_reqs),
        target_argmax=logits.argmax(-1).reshape(-1),
        max_spec_len=k,
        is_greedy=sampling.is_greedy,
        draft_probs=draft_probs.reshape(-1, vocab),
        target_probs=compute_probs(logits, sampling).reshape(-1, vocab),
    )
    u1, e1 = _draws(sampling.seeds, k, vocab, key=1)
    u2, e2 = _draws(sampling.seeds, k, vocab, key=2)
    out, acc = rejection_sample(**base, uniform_samples=u1, exponential_noise=e1)
    out_e, acc_e = rejection_sample(**base, uniform_samples=u1, exponential_noise=e2)
    out_u, acc_u = rejection_sample(**base, uniform_samples=u2, exponential_noise=e1)
    # Other noise: the same accepted drafts, but other recovered/bonus tokens somewhere.
    assert torch.equal(acc_e, acc)
    final = torch.arange(k + 1)[None, :] == acc[:, None]  # [num_reqs, k + 1]
    assert torch.equal(out_e[~final], out[~final])  # accepted drafts and placeholders
    assert not torch.equal(out_e[final], out[final])
    # Other uniforms: other accepted counts.
    assert not torch.equal(acc_u, acc)


# -- distributions ----------------------------------------------------------------------------


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
    position 0 over all requests; position 1 over requests that accepted draft token 0
    (it is then either the accepted draft token 1 or the recovered token of position 1).
    Each request has its own seed; drafts are sampled on the draft streams."""
    vocab, k, n = 8, 2, 40_000
    gen = torch.Generator().manual_seed(7)
    one_target = torch.randn(1, k + 1, vocab, generator=gen) * 1.5
    # A draft that is deliberately wrong in places, so both branches are exercised.
    one_draft = torch.softmax(torch.randn(1, k, vocab, generator=gen) * 1.5, dim=-1)
    target_logits = one_target.expand(n, -1, -1)
    draft_probs = one_draft.expand(n, -1, -1)
    seeds = torch.arange(n) + 1234
    drafts = _sample_drafts(draft_probs, seeds)

    out, num_accepted = _verify(drafts, draft_probs, target_logits, [params] * n, seeds.tolist())

    target_probs = compute_probs(one_target, _metadata([params]))[0]  # [k + 1, vocab]
    accepted_first = (num_accepted >= 1).float().mean().item()
    assert 0.05 < accepted_first < 0.95, f"uninformative case: {accepted_first} accept token 0"
    assert 0 < int((num_accepted == 1).sum()) and 0 < int((num_accepted == k).sum())
    counts0 = torch.bincount(out[:, 0], minlength=vocab)
    assert chi_square(counts0, target_probs[0]) > ALPHA
    second = out[num_accepted >= 1, 1]
    counts1 = torch.bincount(second, minlength=vocab)
    assert chi_square(counts1, target_probs[1]) > ALPHA


def test_deterministic_draft_output_distribution_matches_target(chi_square):
    """Drafts without probabilities (the same tokens for every request, as an n-gram
    lookup proposes): the outputs still follow the target distribution."""
    vocab, k, n = 8, 2, 40_000
    gen = torch.Generator().manual_seed(11)
    one_target = torch.randn(1, k + 1, vocab, generator=gen)
    params = SamplingParams(temperature=1.0)
    probs = compute_probs(one_target, _metadata([params]))[0]
    # Draft the second most likely token at each position.
    drafts = probs[:k].topk(2, dim=-1).indices[:, 1].expand(n, -1)
    out, num_accepted = _verify(
        drafts, None, one_target.expand(n, -1, -1), [params] * n, list(range(n))
    )
    accepted_first = (num_accepted >= 1).float().mean().item()
    assert 0.05 < accepted_first < 0.95, f"uninformative case: {accepted_first} accept token 0"
    assert chi_square(torch.bincount(out[:, 0], minlength=vocab), probs[0]) > ALPHA
    second = out[num_accepted >= 1, 1]
    assert chi_square(torch.bincount(second, minlength=vocab), probs[1]) > ALPHA


def test_bonus_token_distribution(chi_square):
    """When the draft equals the target exactly, all k are accepted and the bonus
    token follows the last target distribution."""
    vocab, k, n = 6, 2, 20_000
    gen = torch.Generator().manual_seed(3)
    one_target = torch.randn(1, k + 1, vocab, generator=gen)
    params = SamplingParams(temperature=1.0)
    probs = compute_probs(one_target, _metadata([params]))[0]
    draft_probs = probs[:k].expand(n, -1, -1)
    seeds = torch.arange(n) + 99
    drafts = _sample_drafts(draft_probs, seeds)
    out, num_accepted = _verify(
        drafts, draft_probs, one_target.expand(n, -1, -1), [params] * n, seeds.tolist()
    )
    assert torch.all(num_accepted == k)
    assert chi_square(torch.bincount(out[:, k], minlength=vocab), probs[k]) > ALPHA


# -- synthetic acceptance (benchmarks) ----------------------------------------------------


def test_engine_synthetic_acceptance_accepts_each_position_at_the_rate(
    tiny_llama_target, tiny_llama_draft
):
    """``synthetic_acceptance_rate`` (vLLM's ``rejection_sample_method="synthetic"``):
    each draft position is accepted with the rate given the ones before it, whatever the
    tokens. The engine's per-position counters are binomial draws: within 4 standard
    deviations of the rate at every position."""
    from specula.api.runtime_config import SpeculatorRuntimeConfig
    from specula.runtime.engine.llm_engine import LLMEngine

    rate, k = 0.8, 4
    spec = SpeculatorRuntimeConfig(method="draft_model", model=f"file://{tiny_llama_draft}",
                                   num_speculative_tokens=k)
    engine = LLMEngine(tiny_llama_target, None, served_model_name="t", speculator_config=spec,
                       dtype="float32", max_num_seqs=8, synthetic_acceptance_rate=rate)
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(1, 100, (8, 5), generator=gen).tolist()
    for i, p in enumerate(prompts):  # seeded: the draws, and so the counts, are fixed
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=96, ignore_eos=True, seed=i))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.spec_decoding_stats
    reached = [stats.num_drafts, *stats.num_accepted_tokens_per_pos[:-1]]
    assert stats.num_drafts > 150
    for n, accepted in zip(reached, stats.num_accepted_tokens_per_pos, strict=True):
        assert abs(accepted - rate * n) <= 4 * (n * rate * (1 - rate)) ** 0.5
