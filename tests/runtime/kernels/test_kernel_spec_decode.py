"""Rejection sampling and draft-input preparation in Triton's interpreter, against their
torch references (``rejection_sample_reference``, ``prepare_draft_inputs_reference``:
what the engine runs on a CPU).

Rejection sampling is checked three ways: hand-built cases with known answers (greedy,
and recovered tokens at the edges of the vocabulary scan); exact agreement with its
torch reference on random inputs (variable draft lengths, greedy and random requests
mixed, with and without draft probabilities, a vocabulary spanning several kernel
chunks); and exact agreement with the reference on the inputs the engine builds
(processed target probabilities of mixed sampling settings, and the counter-based
uniforms and noise of ``specula.runtime.engine.sampler`` drawn from per-request seeds
and keys), which also makes the result a function of the seeds and keys alone. Token
ids are compared exactly: both sides do the same float32 operations.
"""

from __future__ import annotations

import pytest
import torch

from specula.runtime.engine.sampler import (
    STREAM_ACCEPT,
    STREAM_TARGET,
    SamplingMetadata,
    compute_probs,
    random_exponential,
    random_uniform,
)
from specula.runtime.engine.sampling_params import SamplingParams
from specula.runtime.kernels.draft_inputs import (
    draft_step_slots,
    draft_steps,
    draft_steps_reference,
    prepare_draft_inputs,
    prepare_draft_inputs_reference,
)
from specula.runtime.kernels.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    accepted_tokens,
    accepted_tokens_reference,
    rejection_sample,
    rejection_sample_reference,
)

pytestmark = pytest.mark.runtime

P = PLACEHOLDER_TOKEN_ID


def _cu(num_draft: list[int]) -> torch.Tensor:
    return torch.tensor(num_draft).cumsum(0).to(torch.int32)


def check_greedy_hand_built() -> None:
    # Per request: draft tokens, then the target argmax of its n + 1 rows.
    cases = [
        ([5, 6, 7], [5, 6, 7, 9]),  # all accepted: the bonus token 9 follows
        ([1, 2, 3], [1, 4, 3, 8]),  # second rejected: 4 replaces it
        ([2, 2], [0, 2, 2]),  # first rejected
        ([], [11]),  # no draft (a request that just prefilled): its sampled token
    ]
    drafts = torch.tensor([t for d, _ in cases for t in d], dtype=torch.int64)
    argmax = torch.tensor([t for _, a in cases for t in a], dtype=torch.int64)
    cu = _cu([len(d) for d, _ in cases])
    expected = torch.tensor(
        [[5, 6, 7, 9], [1, 4, P, P], [0, P, P, P], [11, P, P, P]], dtype=torch.int64
    )
    for fn in (rejection_sample, rejection_sample_reference):
        out, num_accepted = fn(drafts, cu, argmax, 3)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(num_accepted, torch.tensor([3, 1, 0, 0]), rtol=0, atol=0)
    # A wider output than any request needs is padded.
    out, _ = rejection_sample(drafts, cu, argmax, 5)
    assert out.shape == (4, 6) and torch.all(out[:, 4:] == P)


def test_greedy_hand_built(interpreted):
    interpreted(check_greedy_hand_built)


def check_synthetic_hand_built() -> None:
    # Drafts are accepted while their draws are below the rate, whatever the tokens: row
    # 0's drafts all equal the target argmax yet its second draw rejects the second.
    drafts = torch.tensor([5, 6, 7, 1, 2, 3, 4, 4, 4], dtype=torch.int64)
    argmax = torch.tensor([5, 6, 7, 9, 0, 0, 0, 8, 1, 2, 3, 7], dtype=torch.int64)
    u = torch.tensor([0.1, 0.7, 0.2, 0.9, 0.1, 0.1, 0.3, 0.2, 0.4])
    expected = torch.tensor([[5, 6, P, P], [0, P, P, P], [4, 4, 4, 7]], dtype=torch.int64)
    for fn in (rejection_sample, rejection_sample_reference):
        out, num_accepted = fn(drafts, _cu([3, 3, 3]), argmax, 3, uniform_samples=u,
                               synthetic_acceptance_rate=0.5)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(num_accepted, torch.tensor([1, 0, 3]), rtol=0, atol=0)


def test_synthetic_hand_built(interpreted):
    interpreted(check_synthetic_hand_built)


def check_accepted_tokens_hand_built() -> None:
    """Three verifying requests at k = 3 (input-batch rows 4, 0, 2), then two prefills: the
    accepted count is capped by the row's real drafts (row 0 drafted 1, an n-gram
    proposal), prefills verify nothing whatever their rows hold, and the outputs are
    staged beside the counts; the prefills' tokens are an expanded view (stride 0)."""
    decode = torch.tensor([[5, 6, 7, 9], [1, 4, P, P], [3, 8, 8, P]])
    first = torch.tensor([11, 12])[:, None].expand(-1, 4)
    num_draft = torch.tensor([1, 0, 3, 0, 3, 0, 3])  # per row; row 6 (a prefill) is stale
    idx = torch.tensor([4, 0, 2, 6, 1])
    keys = torch.tensor([100, 50, 70, 16, 9])
    raw = torch.tensor([3, 2, 2])  # the rejection sampler's counts for the verifying three
    for out in (torch.cat([decode, first]), first):
        nd = 3 if out.shape[0] == 5 else 0
        rows, k_ = (idx, keys) if nd else (idx[3:], keys[3:])
        for fn in (accepted_tokens, accepted_tokens_reference):
            staged, next_ids, committed = fn(out, raw if nd else None, num_draft, rows, k_, 3, nd)
            accepted = [3, 1, 2, 0, 0][3 - nd:]
            verified = [3, 1, 3, 0, 0][3 - nd:]
            torch.testing.assert_close(staged[:, 0], torch.tensor(accepted), rtol=0, atol=0)
            assert staged[:, 0].is_contiguous()  # the speculator's copies take it as it is
            torch.testing.assert_close(staged[:, 1], torch.tensor(verified), rtol=0, atol=0)
            torch.testing.assert_close(staged[:, 2:], out, rtol=0, atol=0)
            want_next = [9, 4, 8, 11, 12][3 - nd:]
            torch.testing.assert_close(next_ids, torch.tensor(want_next), rtol=0, atol=0)
            torch.testing.assert_close(committed, k_ + torch.tensor(accepted), rtol=0, atol=0)
    # Target-only decode (k = 0): nothing verified, the one sampled token is next.
    staged, next_ids, committed = accepted_tokens(decode[:, :1], None, num_draft, idx[:3], keys[:3], 0, 3)
    assert staged[:, :2].eq(0).all() and staged[:, 2].tolist() == next_ids.tolist() == [5, 1, 3]
    assert committed.equal(keys[:3])


def test_accepted_tokens_hand_built(interpreted):
    interpreted(check_accepted_tokens_hand_built)
    check_accepted_tokens_hand_built()  # the torch reference's path (what a CPU engine runs)


def test_gemv_prefetch_bounds():
    """What :func:`gemv` fetches of the next weight: nothing without one; at most
    ``PREFETCH_MAX_BYTES`` a launch and ``1 / PREFETCH_SHARE`` of the launch's own weight
    bytes; never past the next weight's end."""
    from specula.runtime.kernels.gemv import PREFETCH_MAX_BYTES, PREFETCH_SHARE, prefetch_lines

    def weight(n, k):
        return torch.empty(n, k, dtype=torch.bfloat16, device="meta")

    o, gate_up, tiny = weight(2048, 2048), weight(16384, 2048), weight(64, 64)  # 8, 64 MiB
    assert prefetch_lines(o, None) == 0
    assert prefetch_lines(gate_up, o) * 128 == PREFETCH_MAX_BYTES
    assert prefetch_lines(o, gate_up) == o.nbytes // PREFETCH_SHARE // 128
    assert prefetch_lines(gate_up, tiny) * 128 == tiny.nbytes


def _random_batch(num_draft: list[int], vocab: int, seed: int, sharpness: float = 2.0):
    """Flattened inputs with draft and target distributions that agree often enough
    that every outcome (accept all, reject at each position) shows up; ``sharpness``
    scales the target logits."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs, total = len(num_draft), sum(num_draft)
    target_logits = torch.randn(total + num_reqs, vocab, generator=gen) * sharpness
    target_probs = target_logits.softmax(-1)
    draft_rows = []
    for req, n in enumerate(num_draft):
        start = sum(num_draft[:req]) + req
        draft_rows.append(target_logits[start : start + n])
    noise = torch.randn(total, vocab, generator=gen)
    draft_probs = (torch.cat(draft_rows) + noise).softmax(-1)
    drafts = torch.multinomial(draft_probs, 1, generator=gen)[:, 0]
    return dict(
        draft_token_ids=drafts,
        cu_num_draft_tokens=_cu(num_draft),
        target_argmax=target_logits.argmax(-1),
        max_spec_len=max(num_draft),
        draft_probs=draft_probs,
        target_probs=target_probs,
        uniform_samples=torch.rand(total, generator=gen),
        exponential_noise=torch.empty(num_reqs, vocab).exponential_(generator=gen),
    )


def check_random_matches_reference(with_draft_probs: bool) -> None:
    num_draft = [4, 0, 2, 4, 1, 3, 4, 4]
    batch = _random_batch(num_draft, vocab=2100, seed=0, sharpness=4.0)  # 2 kernel chunks
    if not with_draft_probs:
        batch["draft_probs"] = None
    batch["is_greedy"] = torch.tensor([False, False, True, False, False, True, False, False])
    out, num_accepted = rejection_sample(**batch)
    ref_out, ref_accepted = rejection_sample_reference(**batch)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(num_accepted, ref_accepted, rtol=0, atol=0)
    # The case is informative: random requests accept all, part, and none of their drafts.
    outcomes = list(zip(num_accepted.tolist(), num_draft, batch["is_greedy"].tolist(), strict=True))
    assert any(a == n > 0 and not g for a, n, g in outcomes)
    assert any(0 < a < n and not g for a, n, g in outcomes)
    assert any(a == 0 < n and not g for a, n, g in outcomes)


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft-probs", "one-hot-draft"])
def test_random_matches_reference(interpreted, with_draft_probs):
    interpreted(check_random_matches_reference, with_draft_probs)


def check_recovered_token_edge_cases() -> None:
    vocab = 2100
    # Request 0: its one draft token is rejected (u = 0.9 > p/q = 0.5); the residual
    # peaks at 10 and 2050 (in the kernel's second 2048-entry chunk) with the same value
    # and noise 1, so argmax takes the first, 10.
    # Request 1: draft "probabilities" equal to p except more mass on the draft token, so
    # the residual max(p - q, 0) is all zero and the recovered token is drawn from p.
    p = torch.full((vocab,), 1e-5)
    p[10] = p[2050] = 0.3
    p[7] = 0.2
    q0 = torch.zeros(vocab)
    q0[7] = 0.4
    q1 = p.clone()
    q1[7] = 0.9
    noise = torch.ones(2, vocab)
    noise[1, 2050] = 0.5  # p / noise peaks at 2050 for request 1
    batch = dict(
        draft_token_ids=torch.tensor([7, 7]),
        cu_num_draft_tokens=_cu([1, 1]),
        target_argmax=torch.zeros(4, dtype=torch.int64),
        max_spec_len=1,
        is_greedy=torch.tensor([False, False]),
        draft_probs=torch.stack([q0, q1]),
        target_probs=torch.stack([p, p, p, p]),
        uniform_samples=torch.tensor([0.9, 0.9]),
        exponential_noise=noise,
    )
    for fn in (rejection_sample, rejection_sample_reference):
        out, num_accepted = fn(**batch)
        torch.testing.assert_close(out, torch.tensor([[10, P], [2050, P]]), rtol=0, atol=0)
        torch.testing.assert_close(num_accepted, torch.tensor([0, 0]), rtol=0, atol=0)


def test_recovered_token_edge_cases(interpreted):
    interpreted(check_recovered_token_edge_cases)


def _engine_inputs(seed: int):
    num_reqs, k, vocab = 6, 3, 40
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(num_reqs, k + 1, vocab, generator=gen) * 2
    draft_probs = (target_logits[:, :k] + torch.randn(num_reqs, k, vocab, generator=gen))
    draft_probs = draft_probs.mul(1.5).softmax(-1)
    drafts = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(num_reqs, k)
    params = [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5, seed=2),
        SamplingParams(temperature=1.2, top_p=0.8, seed=3),
        SamplingParams(temperature=1.0, seed=4),
        SamplingParams(temperature=0.5, seed=5),
    ]
    return drafts, draft_probs, target_logits, params


def check_engine_draws_match_reference(seed: int) -> None:
    """The verification ``LLMEngine._verify`` launches: processed target probabilities,
    per-request counter-based uniforms and noise from seeds and keys (drawn twice, each
    time from scratch); the kernel equals the reference every time."""
    drafts, draft_probs, target_logits, params = _engine_inputs(seed)
    num_reqs, k, vocab = draft_probs.shape
    seeds = [1000 + seed if p.seed is None else p.seed for p in params]
    sampling = SamplingMetadata.from_params(params, seeds, torch.device("cpu"))
    keys = torch.arange(num_reqs, dtype=torch.int64) * 3 + 17  # per-request positions

    results = []
    for fn in (rejection_sample, rejection_sample_reference, rejection_sample):
        target_probs = compute_probs(target_logits, sampling)  # [num_reqs, k + 1, vocab]
        results.append(
            fn(
                drafts.flatten(),
                torch.arange(1, num_reqs + 1, dtype=torch.int32) * k,
                target_logits.argmax(-1).flatten(),
                k,
                is_greedy=sampling.is_greedy,
                draft_probs=draft_probs.flatten(0, 1),
                target_probs=target_probs.flatten(0, 1),
                uniform_samples=random_uniform(sampling.seeds, keys, STREAM_ACCEPT, k).flatten(),
                exponential_noise=random_exponential(sampling.seeds, keys, STREAM_TARGET, vocab),
            )
        )
    expected = results[1]
    for out, num_accepted in results:
        torch.testing.assert_close(out, expected[0], rtol=0, atol=0)
        torch.testing.assert_close(num_accepted, expected[1], rtol=0, atol=0)
    # The greedy request (1) follows the argmax rule.
    argmax = target_logits[1].argmax(-1)
    n = int((drafts[1] == argmax[:k]).long().cumprod(0).sum())
    assert int(expected[1][1]) == n and int(expected[0][1, n]) == int(argmax[n])
    # Informative: random requests that reject their first draft and some that accept.
    greedy = sampling.is_greedy.tolist()
    sampled = [a for a, g in zip(expected[1].tolist(), greedy, strict=True) if not g]
    assert 0 in sampled and max(sampled) > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_engine_draws_match_reference(interpreted, seed):
    interpreted(check_engine_draws_match_reference, seed)


def check_prepare_draft_inputs() -> None:
    # Request 0 verified [10, d1, d2, d3] and accepted 1; request 1 prefilled 3 prompt
    # tokens (no drafts); request 2 verified [30, e1, e2] and accepted both.
    input_ids = torch.tensor([10, 11, 12, 13, 20, 21, 22, 30, 31, 32])
    positions = torch.tensor([5, 6, 7, 8, 0, 1, 2, 9, 10, 11])
    query_start_loc = torch.tensor([0, 4, 7, 10], dtype=torch.int32)
    cu_num_draft_tokens = _cu([3, 0, 2])
    num_accepted = torch.tensor([1, 0, 2])
    next_token_ids = torch.tensor([99, 98, 97])
    args = (input_ids, positions, query_start_loc, cu_num_draft_tokens, num_accepted,
            next_token_ids)
    expected_ids = torch.tensor([11, 99, 99, 99, 21, 22, 98, 31, 32, 97])
    expected_last = torch.tensor([1, 6, 9])
    for fn in (prepare_draft_inputs, prepare_draft_inputs_reference):
        ids, pos, last = fn(*args)
        torch.testing.assert_close(ids, expected_ids, rtol=0, atol=0)
        torch.testing.assert_close(pos, positions, rtol=0, atol=0)
        torch.testing.assert_close(last, expected_last, rtol=0, atol=0)

    # Longer than one 128-token kernel block, into preallocated (larger) buffers.
    gen = torch.Generator().manual_seed(0)
    lens = [150, 4, 1, 300]
    drafted = [0, 3, 0, 2]
    input_ids = torch.randint(0, 1000, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) + 7 for n in lens])
    query_start_loc = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    args = (input_ids, positions, query_start_loc, _cu(drafted), torch.tensor([0, 2, 0, 0]),
            torch.tensor([1, 2, 3, 4]))
    buffers = dict(
        out_input_ids=torch.full((512,), -7),
        out_positions=torch.full((512,), -7),
        out_last_token_indices=torch.full((8,), -7),
    )
    ids, pos, last = prepare_draft_inputs(*args, **buffers)
    ref_ids, ref_pos, ref_last = prepare_draft_inputs_reference(*args)
    n = sum(lens)
    torch.testing.assert_close(ids[:n], ref_ids, rtol=0, atol=0)
    torch.testing.assert_close(pos[:n], ref_pos, rtol=0, atol=0)
    torch.testing.assert_close(last[:4], ref_last, rtol=0, atol=0)
    assert torch.all(ids[n:] == -7) and torch.all(last[4:] == -7)


def test_prepare_draft_inputs(interpreted):
    interpreted(check_prepare_draft_inputs)


def _slots_reference(positions, valid, block_table, block_size, writes_kv=True):
    return draft_steps_reference(positions, valid, block_table, block_size, writes_kv=writes_kv)[1:]


def check_draft_step_slots() -> None:
    # Blocks of 4 tokens; request 0 holds blocks [7, 2, 9], request 1 [5, 3], request 2
    # is a padding row.
    block_table = torch.tensor([[7, 2, 9], [5, 3, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.int32)
    valid = torch.tensor([True, True, False])
    positions = torch.tensor([[3, 4], [6, 7], [0, 1]])  # q = 2: request 0 crosses a block
    expected_slots = torch.tensor([7 * 4 + 3, 2 * 4 + 0, 3 * 4 + 2, 3 * 4 + 3, -1, -1])
    expected_lens = torch.tensor([5, 8, 0], dtype=torch.int32)
    for fn in (draft_step_slots, _slots_reference):
        slots, lens = fn(positions, valid, block_table, 4)
        torch.testing.assert_close(slots, expected_slots, rtol=0, atol=0)
        torch.testing.assert_close(lens, expected_lens, rtol=0, atol=0)

    # Rows on the target's KV (Gemma4 MTP): no slot written, attending before the row.
    for fn in (draft_step_slots, _slots_reference):
        slots, lens = fn(positions, valid, block_table, 4, writes_kv=False)
        torch.testing.assert_close(slots, torch.full((6,), -1), rtol=0, atol=0)
        torch.testing.assert_close(lens, torch.tensor([4, 7, 0], dtype=torch.int32), rtol=0, atol=0)

    # Three steps at once from each request's start (-1: a padding row), one position on.
    start = torch.tensor([[3], [6], [-1]])
    want_pos = torch.tensor([[3, 6, 0], [4, 7, 1], [5, 8, 2]])
    want_slots = torch.tensor([[7 * 4 + 3, 3 * 4 + 2, -1], [2 * 4 + 0, 3 * 4 + 3, -1],
                               [2 * 4 + 1, 0 * 4 + 0, -1]])
    want_lens = torch.tensor([[4, 7, 0], [5, 8, 0], [6, 9, 0]], dtype=torch.int32)
    for fn in (draft_steps, lambda *a, **kw: draft_steps_reference(a[0], None, *a[1:], **kw)):
        pos, slots, lens = fn(start, block_table, 4, 3, shift=1)
        for got, want in ((pos, want_pos), (slots, want_slots), (lens, want_lens)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    # No shift, no KV written (Gemma4 MTP); a token-only draft's first pair [p - 1, p].
    pos, slots, lens = draft_steps(start, block_table, 4, 2, shift=0, writes_kv=False)
    assert pos.tolist() == [[3, 6, 0]] * 2 and slots.tolist() == [[-1] * 3] * 2
    assert lens.tolist() == [[3, 6, 0]] * 2
    pos, slots, lens = draft_steps(start + torch.tensor([-1, 0]), block_table, 4, 1)
    assert pos.tolist() == [[2, 3, 5, 6, 0, 0]] and lens.tolist() == [[4, 7, 0]]
    assert slots.tolist() == [[7 * 4 + 2, 7 * 4 + 3, 3 * 4 + 1, 3 * 4 + 2, -1, -1]]

    # One row per request over a wider table, against the reference.
    gen = torch.Generator().manual_seed(0)
    block_table = torch.randint(0, 500, (9, 40), generator=gen, dtype=torch.int32)
    positions = torch.randint(0, 16 * 40, (8, 1), generator=gen)
    valid = torch.rand(8, generator=gen) > 0.3
    for got, want in zip(draft_step_slots(positions, valid, block_table, 16),
                         _slots_reference(positions, valid, block_table, 16), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    start = torch.where(valid[:, None], positions.clamp(max=16 * 40 - 6), -1)
    for got, want in zip(draft_steps(start, block_table, 16, 5),
                         draft_steps_reference(start, None, block_table, 16, 5, 1), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_draft_step_slots(interpreted):
    interpreted(check_draft_step_slots)


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _draw_bits_python(seed: int, key: int, stream: int, col: int) -> int:
    """The counter-based hash written out in Python integers (an independent check)."""
    seed &= (1 << 64) - 1
    row = _lowbias32((seed & 0xFFFFFFFF) ^ _lowbias32(stream))
    row = _lowbias32(row ^ (seed >> 32))
    row = _lowbias32(row ^ (key & 0xFFFFFFFF))
    return _lowbias32(row ^ ((col * 0x9E3779B1) & 0xFFFFFFFF))


def check_random_draws() -> None:
    from specula.runtime.kernels.random import (
        MODE_BITS,
        MODE_EXPONENTIAL,
        MODE_UNIFORM,
        random_draws,
        random_draws_reference,
    )

    seeds = torch.tensor([0, 7, 2**62 + 5, -3, 123456789012345], dtype=torch.int64)
    keys = torch.tensor([1, 2**31 + 9, 0, 40, 2**32 - 1], dtype=torch.int64)
    for stream, cols in ((0, 3), (1, 37), (5, 2100)):
        bits = random_draws(seeds, keys, stream, cols, MODE_BITS)
        ref = random_draws_reference(seeds, keys, stream, cols, MODE_BITS)
        torch.testing.assert_close(bits, ref, rtol=0, atol=0)
        for i, (s, k) in enumerate(zip(seeds.tolist(), keys.tolist(), strict=True)):
            for c in (0, cols - 1):
                assert int(bits[i, c]) == _draw_bits_python(s, k, stream, c)
        u = random_draws(seeds, keys, stream, cols, MODE_UNIFORM)
        torch.testing.assert_close(
            u, random_draws_reference(seeds, keys, stream, cols, MODE_UNIFORM), rtol=0, atol=0
        )
        assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
        e = random_draws(seeds, keys, stream, cols, MODE_EXPONENTIAL)
        ref_e = random_draws_reference(seeds, keys, stream, cols, MODE_EXPONENTIAL)
        torch.testing.assert_close(e, ref_e, rtol=1e-5, atol=1e-6)
        assert bool((e > 0).all()) and bool(torch.isfinite(e).all())


def test_random_draws(interpreted):
    interpreted(check_random_draws)


def test_random_draws_reference_matches_python_hash():
    check_random_draws()  # in this process: the torch reference on the CPU



def check_gemv() -> None:
    from specula.runtime.kernels.gemv import gemv, gemv_reference

    gen = torch.Generator().manual_seed(1)
    for m, n, k, cfg in ((1, 64, 256, (32, 128, 4, 3)), (5, 96, 384, (32, 128, 4, 3)),
                         (8, 48, 200, (16, 128, 4, 3)), (16, 64, 512, (64, 256, 4, 3))):
        x = torch.randn(m, k, generator=gen).half()
        w = (torch.randn(n, k, generator=gen) * 0.05).half()
        y = gemv(x, w, cfg).float()
        ref = gemv_reference(x.float(), w.float())
        assert ((y - ref).norm() / ref.norm()).item() < 2e-3


def test_gemv(interpreted):
    interpreted(check_gemv)


def check_gemv_one_row_config() -> None:
    """``CONFIGS``' key 1 is one row's configuration, the row tile's key every other row
    count's: the argmax partials (one per program) show each launch's column tile."""
    from specula.runtime.kernels import gemv

    shape, merge, tiles = (64, 256), gemv._merge_argmax, []
    saved = gemv.CONFIGS.get(shape)
    gemv.CONFIGS[shape] = {1: (16, 128, 4, 3), 16: (32, 128, 4, 3)}
    gemv._merge_argmax = lambda part_max, *rest: tiles.append(part_max.shape[1]) or merge(part_max, *rest)
    try:
        gen = torch.Generator().manual_seed(4)
        w = (torch.randn(*shape, generator=gen) * 0.05).half()
        for m in (1, 3):
            x = torch.randn(m, shape[1], generator=gen).half()
            y, best = gemv.gemv(x, w, with_argmax=True)
            assert torch.equal(best, y.float().argmax(-1))
    finally:
        gemv._merge_argmax = merge
        gemv.CONFIGS.pop(shape) if saved is None else gemv.CONFIGS.update({shape: saved})
    assert tiles == [64 // 16, 64 // 32]


def test_gemv_one_row_config(interpreted):
    interpreted(check_gemv_one_row_config)


def test_cublaslt_rows_lie_past_the_gemv_row_tiles():
    """Every row count of an ``LT_ROWS`` range reaches the library GEMM: none falls in a
    row tile the GEMV takes for that shape (``linear`` would never ask for cuBLASLt there)."""
    from specula.runtime.kernels.gemv import CONFIGS, LT_ROWS, block_m

    for shape, (low, high) in LT_ROWS.items():
        assert 1 <= low <= high
        assert not any(block_m(m) in CONFIGS.get(shape, {}) for m in range(low, high + 1)), shape


def check_gemv_epilogues() -> None:
    from specula.runtime.kernels.activation import silu_and_mul
    from specula.runtime.kernels.gemv import argmax, gemv, gemv_reference

    gen = torch.Generator().manual_seed(2)
    for m, n, k, cfg in ((1, 64, 256, (32, 128, 4, 3)), (5, 40, 200, (32, 128, 4, 3)),
                         (16, 96, 256, (64, 128, 4, 3))):
        # float16: the interpreter's bfloat16 dot products are not exact.
        x = torch.randn(m, k, generator=gen).half()
        w = (torch.randn(2 * n, k, generator=gen) * 0.05).half()
        # SwiGLU epilogue: exactly the rounding of the unfused GEMV, then activation.
        fused = gemv(x, w, cfg, silu_mul=True)
        assert fused.shape == (m, n) and fused.dtype == torch.float16
        torch.testing.assert_close(fused, silu_and_mul(gemv(x, w, cfg)), atol=0, rtol=0)
        ref = silu_and_mul(gemv_reference(x.float(), w.float()))
        assert ((fused.float() - ref).norm() / ref.norm()).item() < 2e-3
        # Argmax epilogue: the logits unchanged, and the first index of each row's maximum,
        # ties (repeated weight rows) across programs and within one included.
        w = w[:n].clone()
        w[n - 3] = w[7]
        w[9] = w[7]
        logits, idx = gemv(x, w, cfg, with_argmax=True)
        torch.testing.assert_close(logits, gemv(x, w, cfg), atol=0, rtol=0)
        assert idx.dtype == torch.int64 and torch.equal(idx, logits.float().argmax(-1))
        ref = gemv_reference(x.float(), w.float())
        assert ((logits.float() - ref).norm() / ref.norm()).item() < 2e-3
        # A vocabulary shard's offer: each row's maximum and its column plus the offset.
        pairs = torch.full((2, m), float("nan"))
        assert gemv(x, w, cfg, with_argmax=True, argmax_into=(pairs, 1000))[1] is pairs
        assert torch.equal(pairs[0], logits.float().amax(-1)) and torch.equal(pairs[1], idx + 1000.0)
        # Into a column of a draft's tokens ([k, r] storage, transposed): that column only.
        drafts = torch.full((3, m), -5).t()
        assert gemv(x, w, cfg, with_argmax=True, argmax_into=drafts[:, 1])[1].data_ptr() == drafts[:, 1].data_ptr()
        assert torch.equal(drafts[:, 1], idx) and (drafts[:, [0, 2]] == -5).all()
        x[0] = w[7]  # row 0's maximum is at the repeated rows: the first one wins
        assert int(gemv(x, w, cfg, with_argmax=True)[1][0]) == 7
        x[0] = float("nan")  # NaN counts as -inf: a NaN row still gets a column of the vocabulary
        assert int(gemv(x, w, cfg, with_argmax=True)[1][0]) == 0
    # The merge of the programs' partials reads them only: a row's program writing into
    # them would race with row 0's (it overwrote row 0's first partials).
    from specula.runtime.kernels.gemv import _merge_argmax

    part_max = torch.tensor([[1.0, 5.0, 5.0, 2.0], [3.0, 0.0, 9.0, 9.0], [4.0, 4.0, 1.0, 0.0]])
    part_idx = torch.arange(12, dtype=torch.int32).view(3, 4) * 10
    kept = part_max.clone()
    assert _merge_argmax(part_max, part_idx).tolist() == [10, 60, 80]
    assert torch.equal(part_max, kept)
    # The two-pass argmax of logits the library GEMM computed: ties within a chunk,
    # across chunks, and a constant row.
    logits = torch.randn(4, 9000, generator=gen).half()
    logits[1, 8500] = logits[1, 30] = logits[1, 4500] = 50.0
    logits[2, 4097] = logits[2, 4099] = 50.0
    logits[3] = 1.0
    idx = argmax(logits)
    assert idx.dtype == torch.int64 and idx.tolist()[1:] == [30, 4097, 0]
    assert torch.equal(idx, logits.argmax(-1))
    nan = logits.clone()  # NaN as -inf: the largest other value, or column 0 of a NaN row
    nan[0], nan[1, :5000] = float("nan"), float("nan")
    assert argmax(nan).tolist() == [0, 8500, 4097, 0]
    pairs = torch.empty(2, 4)
    assert argmax(logits, (pairs, 7)) is pairs and torch.equal(pairs[1], idx + 7.0)
    assert torch.equal(pairs[0], logits.float().amax(-1))
    out = torch.full((4,), -1)
    assert argmax(logits, out) is out and torch.equal(out, idx)


def test_gemv_epilogues(interpreted):
    interpreted(check_gemv_epilogues)


def screen_bounds(x: torch.Tensor, q: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 pass's bounds in float64, as the rescoring forms them from its outputs: ``(upper
    [M, N], each program's lower bound [M, P])``, its best column's centre less ``||x||`` times
    that row's bound."""
    from specula.runtime.kernels.gemv import SCREEN_CONFIG, gemv

    centre, top, top_bound = gemv(x, q, SCREEN_CONFIG, screen=aux)
    assert centre.dtype == top.dtype == top_bound.dtype == torch.float32
    padded = torch.full((centre.shape[0], top.shape[1] * SCREEN_CONFIG[0]), float("-inf"))
    padded[:, : centre.shape[1]] = torch.where(centre.isnan(), float("-inf"), centre)
    col = padded.unflatten(1, (-1, SCREEN_CONFIG[0])).argmax(-1)  # each program's first best centre
    col += torch.arange(0, padded.shape[1], SCREEN_CONFIG[0])
    assert torch.equal(top, centre.gather(1, col)) and torch.equal(top_bound, aux[1][col])
    norm = x.double().norm(dim=1, keepdim=True)
    return centre.double() + norm * aux[1].double(), top.double() - norm * top_bound.double()


def check_screened_argmax() -> None:
    """The int8 pass bounds every logit (against float64) and leaves few candidates on random
    rows; the tokens are the first argmax of the logits rounded to float16, also where rows tie
    (the first wins) and where many nearly tie (float16: the interpreter has no bfloat16 dot;
    the GPU test takes bfloat16)."""
    from specula.runtime.kernels.gemv import SCREEN_CONFIG, gemv, screen_weight, screened_argmax

    gen = torch.Generator().manual_seed(7)
    for m, n, k in ((1, 300, 200), (3, 2100, 136)):
        x = torch.randn(m, k, generator=gen).half()
        w = (torch.randn(n, k, generator=gen) * 0.05).half()
        q, aux = screen_weight(w, rows=128)
        upper, lower = screen_bounds(x, q, aux)
        exact = x.double() @ w.double().T
        assert (upper >= exact).all() and (upper - 2 * aux[1].double() * x.double().norm(dim=1, keepdim=True)
                                           <= exact).all()
        threshold = lower.amax(1, keepdim=True)
        assert ((upper.half() >= threshold.half()).sum(1) < n // 20).all()
        assert torch.equal(screened_argmax(x, w, (q, aux)), exact.half().argmax(-1))
        # Ties: the best row copied to a lower index; near-ties: scaled copies of it.
        best = int(exact[0].argmax())
        w[best // 2] = w[best]
        w[best // 2 + 1 : best // 2 + 30] = w[best] * (1 - 2 ** -9 * torch.rand(29, 1, generator=gen)).half()
        ref = (x.double() @ w.double().T).half().argmax(-1)
        into = torch.empty(m, dtype=torch.int64)
        assert screened_argmax(x, w, screen_weight(w), into) is into and torch.equal(into, ref)
        assert int(ref[0]) == best // 2
        x[0], x[-1, 3] = float("nan"), float("inf")  # still a token of the vocabulary
        tokens = screened_argmax(x, w, screen_weight(w))  # NaN: no candidate, token 0; inf: a
        assert int(tokens[0]) == 0 and (m == 1 or w[int(tokens[-1]), 3] > 0)  # column whose logit is +inf
    # Weights on the int8 grid (no quantization error: only the slack separates the bounds) and
    # near-copies of the best row below it: the first whose logit, rounded, equals the maximum
    # lies under the threshold unrounded, so only the rounded comparison keeps it.
    q = torch.randint(-127, 128, (300, 136), generator=gen)
    q[:, 0], best = 127, 200
    for i in range(30):
        j = 1 + int(torch.randint(0, 135, (1,), generator=gen))
        while q[best, j] < 40:
            j = 1 + j % 135
        q[100 + i] = q[best]
        q[100 + i, j] -= 1 + i % 3
    w = (q.double() * 2**-7).half()
    x = (w[best].double() * (1.9995 / w[best].double().pow(2).sum())).half()[None]
    exact = (x.double() @ w.double().T)[0]
    q8, aux = screen_weight(w, rows=128)
    _, lower = screen_bounds(x, q8, aux)
    assert torch.equal(q8, q.to(torch.int8))
    for p, low in enumerate(lower[0].tolist()):  # each program's lower bound: below its columns' max
        assert low <= exact[p * SCREEN_CONFIG[0] : (p + 1) * SCREEN_CONFIG[0]].max()
    ref = int(exact.half().argmax())
    assert 100 <= ref < 130 and exact[ref] < lower.max()
    assert int(screened_argmax(x, w, (q8, aux))) == ref
    # A row (b) whose rounding error lines up with x (x of +-1, each weight 7/16 of a step off the
    # grid, against x's sign) and an on-grid row (a) just above it: b's centre overshoots a's upper
    # bound, so only the lower bound (b's centre less ||x|| times its bound) keeps a a candidate.
    sign = torch.where(torch.rand(128, generator=gen) < 0.5, -1.0, 1.0)
    qb = torch.randint(0, 100, (128,), generator=gen) * sign
    qb[0], sign[0] = 127, 1.0
    q = torch.randint(-3, 4, (300, 128), generator=gen).double()
    q[200], q[201] = qb - 0.4375 * sign, qb
    q[201, 1:31] -= sign[1:31]  # a: 30 steps below b's exact logit plus its error
    q[201, 0] = q[200, 0] = 127
    w, x = (q * 2**-7).half(), sign.half()[None]
    exact = (x.double() @ w.double().T)[0]
    q8, aux = screen_weight(w)
    centre = gemv(x, q8, SCREEN_CONFIG, screen=aux)[0][0].double()
    upper, lower = screen_bounds(x, q8, aux)
    assert exact[200] < exact[201] < upper[0, 201] < centre[200] and lower.max() <= exact[201]
    assert int(exact.half().argmax()) == 201 and int(screened_argmax(x, w, (q8, aux))) == 201
    # The mirror case: the argmax's row (a) off the grid with its error along x (its centre 0.43
    # under its logit), an on-grid row (b) above a's centre but below its logit: only the norm
    # term of a's upper bound keeps a a candidate.
    q[200], q[201] = qb, qb + 0.4375 * sign
    q[200, 1:31] += sign[1:31]
    q[201, 0] = q[200, 0] = 127
    w = (q * 2**-7).half()
    exact = (x.double() @ w.double().T)[0]
    q8, aux = screen_weight(w)
    centre = gemv(x, q8, SCREEN_CONFIG, screen=aux)[0][0].double()
    assert centre[201] < centre[200] and exact[200] < exact[201]
    assert int(exact.half().argmax()) == 201 and int(screened_argmax(x, w, (q8, aux))) == 201


def test_screened_argmax(interpreted):
    interpreted(check_screened_argmax)


def check_gemv_folded_norm_epilogues() -> None:
    from specula.runtime.kernels.gemv import fold_norm_weight, gemv
    from specula.runtime.kernels.layernorm import fused_add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(4)
    for m, n, k, cfg in ((1, 64, 256, (32, 128, 4, 3)), (5, 40, 200, (32, 128, 4, 3)),
                         (16, 96, 384, (64, 128, 4, 3))):
        x = torch.randn(m, k, generator=gen).half()
        w = (torch.randn(n, k, generator=gen) * 0.05).half()
        residual = torch.randn(m, n, generator=gen).half()
        # Residual epilogue: the add rounded as fused_add_rms_norm's, and the sums of
        # squares of the output's parts.
        stream, sum_sq = gemv(x, w, cfg, residual=residual)
        assert torch.equal(stream, fused_add_rms_norm(gemv(x, w, cfg), residual, w[0, :n], 1e-5)[1])
        assert sum_sq.shape == (m, -(-n // cfg[0])) and sum_sq.dtype == torch.float32
        torch.testing.assert_close(sum_sq.sum(-1), stream.float().pow(2).sum(-1))
        # The sums of squares alone (MTP's eh_proj): the product unchanged, no add.
        y, squares = gemv(x, w, cfg, sums_of_squares=True)
        assert torch.equal(y, gemv(x, w, cfg)) and squares.shape == sum_sq.shape
        torch.testing.assert_close(squares.sum(-1), y.float().pow(2).sum(-1))
        # 1/rms epilogue with the norm weight folded in: rms_norm(stream) then the product.
        g = (1 + 0.2 * torch.randn(n, generator=gen)).half()
        w2 = (torch.randn(2 * 48, n, generator=gen) * 0.05).half()
        folded = w2.clone()
        fold_norm_weight(folded, g)
        for silu_mul in (False, True):
            got = gemv(stream, folded, (32, 128, 4, 3), silu_mul=silu_mul, rms=(sum_sq, 1e-5))
            ref = gemv(rms_norm(stream, g, 1e-5), w2, (32, 128, 4, 3), silu_mul=silu_mul)
            assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 5e-3


def test_gemv_folded_norm_epilogues(interpreted):
    interpreted(check_gemv_folded_norm_epilogues)


def check_gemv_split_k() -> None:
    from specula.runtime.kernels import gemv as kernels
    from specula.runtime.kernels.activation import silu_and_mul
    from specula.runtime.kernels.gemv import gemv, gemv_reference
    from specula.runtime.kernels.layernorm import fused_add_rms_norm

    counters = kernels._split_counts  # every launch below that may split takes the split
    taken: list = []
    kernels._split_counts = lambda device, grid: taken.append(counters(device, grid)) or taken[-1]
    gen = torch.Generator().manual_seed(5)
    for m, n, k, split in ((1, 64, 512, 2), (5, 40, 512, 4), (16, 96, 1024, 8)):
        cfg = (32, 128, 4, 3, split)
        x = torch.randn(m, k, generator=gen).half()
        w = (torch.randn(2 * n, k, generator=gen) * 0.05).half()
        y = gemv(x, w, cfg)
        ref = gemv_reference(x.float(), w.float())
        assert ((y.float() - ref).norm() / ref.norm()).item() < 2e-3
        assert torch.equal(gemv(x, w, cfg), y)  # the partials summed in split order
        # The epilogues run once, on the summed tile.
        torch.testing.assert_close(gemv(x, w, cfg, silu_mul=True), silu_and_mul(y), atol=0, rtol=0)
        residual = torch.randn(m, n, generator=gen).half()
        stream, sum_sq = gemv(x, w[:n], cfg, residual=residual)
        assert torch.equal(stream, fused_add_rms_norm(gemv(x, w[:n], cfg), residual, w[0, :n], 1e-5)[1])
        torch.testing.assert_close(sum_sq.sum(-1), stream.float().pow(2).sum(-1))
        logits, idx = gemv(x, w[:n], cfg, with_argmax=True)
        assert torch.equal(idx, logits.float().argmax(-1))
        # Every column tile's counter is back at zero for the next launch.
        assert not kernels._SPLIT_COUNTS[x.device].any()
    # A split that does not divide the reduction runs unsplit.
    x = torch.randn(3, 384, generator=gen).half()
    w = (torch.randn(64, 384, generator=gen) * 0.05).half()
    assert torch.equal(gemv(x, w, (32, 128, 4, 3, 2)), gemv(x, w, (32, 128, 4, 3)))
    assert len(taken) == 3 * 6 and all(c is not None for c in taken)


def test_gemv_split_k(interpreted):
    interpreted(check_gemv_split_k)


def _folded_norm_decoder(gemv_shapes: bool) -> None:
    import copy
    import json
    import tempfile
    from pathlib import Path

    from paged_schedule import metadata_from_block_manager

    from specula.runtime.engine.block_manager import BlockManager
    from specula.runtime.kernels import gemv
    from specula.runtime.models.registry import load_model
    from specula.runtime.worker import model_runner
    from specula.runtime.worker.model_runner import ModelRunner
    from specula.runtime.worker.paged_kv import KVCacheSpec, PagedKVCache

    epilogues: list[str] = []  # the runner's GEMV calls with a residual or 1/rms epilogue

    def spy(*args, **kwargs):
        epilogues.extend(k for k in ("residual", "rms") if kwargs.get(k) is not None)
        return gemv.gemv(*args, **kwargs)

    model_runner.gemv = spy
    cpu = torch.device("cpu")
    path = Path(tempfile.mkdtemp())
    (path / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )))
    if gemv_shapes:  # qkv, o, gate_up, down: every projection through the GEMV epilogues
        for shape in ((128, 64), (64, 64), (256, 64), (64, 128)):
            gemv.CONFIGS[shape] = {16: (32, 64, 4, 2)}
    torch.manual_seed(0)
    model = load_model(path, torch.float16, cpu, load_format="dummy")
    with torch.no_grad():  # norm weights other than 1, or folding them changes nothing
        for layer in model.model.layers:
            layer.input_layernorm.weight.normal_(1.0, 0.2)
            layer.post_attention_layernorm.weight.normal_(1.0, 0.2)
    unfolded = copy.deepcopy(model)
    outputs = []
    for m, fold in ((model, True), (unfolded, False)):
        spec = KVCacheSpec.from_model_config(m.config, torch.float16, 16)
        runner = ModelRunner(m, PagedKVCache(spec, 16, cpu), 64, fold=fold)
        assert runner.norms_folded == fold
        manager = BlockManager(16, 16, 0.0)
        for r in (0, 1):
            manager.allocate(r, 6)
        md, pos = metadata_from_block_manager(manager, [0, 1], [6, 6], runner.max_blocks_per_req, cpu)
        prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1))
        prefill, _ = runner.forward(prompt, pos, md)
        for r in (0, 1):
            manager.append_slots(r, 1)
        md, pos = metadata_from_block_manager(manager, [0, 1], [1, 1], runner.max_blocks_per_req, cpu)
        decode, aux = runner.forward(torch.tensor([3, 9]), pos, md, aux_layer_ids=(0, 1, 2))
        outputs.append((prefill, decode, aux))
    for got, want in zip(*outputs, strict=True):
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-2
    # Two forwards x two layers: o_proj and down_proj add the residual; qkv_proj after the
    # first layer and gate_up_proj scale by 1/rms. None without GEMV shapes.
    expected = {"residual": 8, "rms": 6} if gemv_shapes else {}
    assert {k: epilogues.count(k) for k in set(epilogues)} == expected


def check_folded_norm_decoder(gemv_shapes: bool) -> None:
    # The interpreter's worker process serves the whole session: put back what this
    # check patches (the runner's gemv, tiny GEMV configurations) for the next one.
    from specula.runtime.kernels import gemv
    from specula.runtime.worker import model_runner

    configs = dict(gemv.CONFIGS)
    try:
        _folded_norm_decoder(gemv_shapes)
    finally:
        model_runner.gemv = gemv.gemv
        gemv.CONFIGS.clear()
        gemv.CONFIGS.update(configs)


@pytest.mark.parametrize("gemv_shapes", [True, False])
def test_folded_norm_decoder_matches_the_norm_kernels(interpreted, gemv_shapes):
    """A runner with its norms folded (:func:`fold_norms`) against one on a copy with the
    norm kernels, a prefill then a decode step of two requests: every projection through
    the GEMV's residual and 1/rms epilogues, or none (the library GEMM and unit-weight
    norms, the adds left to the norm kernels)."""
    interpreted(check_folded_norm_decoder, gemv_shapes)


def test_linear_takes_the_library_gemm_off_cuda_and_for_untuned_shapes():
    from specula.runtime.kernels.gemv import CONFIGS, linear, use_gemv

    n, k = next(iter(CONFIGS))
    x, w = torch.randn(2, k).bfloat16(), torch.randn(n, k).bfloat16()
    assert not use_gemv(x, w)  # a CPU tensor: the reference path
    small = torch.randn(3, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    assert not use_gemv(*small)
    torch.testing.assert_close(linear(*small), torch.nn.functional.linear(*small))


def test_epilogue_launchers_take_the_references_off_cuda():
    from specula.runtime.kernels.activation import silu_and_mul_reference
    from specula.runtime.kernels.gemv import linear_argmax, linear_silu_and_mul

    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 8, generator=gen), torch.randn(10, 8, generator=gen)
    ref = torch.nn.functional.linear(x, w)
    torch.testing.assert_close(linear_silu_and_mul(x, w), silu_and_mul_reference(ref))
    bias = torch.randn(10, generator=gen)
    torch.testing.assert_close(
        linear_silu_and_mul(x, w, bias), silu_and_mul_reference(ref + bias)
    )
    logits, idx = linear_argmax(x, w)
    torch.testing.assert_close(logits, ref)
    assert torch.equal(idx, ref.argmax(-1))
    pairs = linear_argmax(x, w, (torch.empty(2, 3), 20))[1]
    assert torch.equal(pairs[0], ref.amax(-1)) and torch.equal(pairs[1], ref.argmax(-1) + 20.0)
