"""The Triton kernels compiled for the GPU, at Llama-3.1-8B shapes in bfloat16, against
their torch references (and paged attention also against ``scaled_dot_product_attention``
on the gathered keys and values), plus one CUDA-graph capture of a verification step.

Run on the GPU machine: ``python -m pytest -m gpu tests/gpu``.

Tolerances: attention outputs 2e-2 absolute (bfloat16 softmax weights and outputs);
norm and rotary outputs two bfloat16 units in the last place (float32 reduction order and
fused multiply-adds move rounding boundaries); cache writes, residual sums, sampled
tokens and draft inputs exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from specula.runtime.engine.sampler import (
    SamplingMetadata,
    compute_probs,
    random_exponential,
    random_uniform,
)
from specula.runtime.engine.sampling_params import SamplingParams
from specula.runtime.kernels.draft_inputs import (
    prepare_draft_inputs,
    prepare_draft_inputs_reference,
)
from specula.runtime.kernels.layernorm import fused_add_rms_norm, rms_norm, rms_norm_reference
from specula.runtime.kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
)
from specula.runtime.kernels.rejection_sampler import (
    rejection_sample,
    rejection_sample_reference,
)
from specula.runtime.kernels.reshape_and_cache import (
    reshape_and_cache,
    reshape_and_cache_reference,
)
from specula.runtime.kernels.rotary import (
    build_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_and_cache,
    rotary_embedding_reference,
)
from specula.runtime.models.layers import RotaryEmbedding

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 32, 8, 128, 4096, 128256
BLOCK_SIZE = 16
BF16_TOL = {"atol": 1e-5, "rtol": 2**-6}


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, req: int, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` cached tokens of request ``req``: [seq_len, num_kv_heads, head_dim]."""
    blocks = block_table[req, : -(-seq_len // cache.shape[1])].long()
    return cache[blocks].flatten(0, 1)[:seq_len]


def _paged_case(seq_lens: list[int], q_len: int, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator(DEVICE).manual_seed(seed)
    num_reqs = len(seq_lens)
    max_blocks = max(triton.cdiv(s, BLOCK_SIZE) for s in seq_lens)
    num_blocks = num_reqs * max_blocks + 7
    table = torch.randperm(num_blocks, generator=gen, device=DEVICE)[: num_reqs * max_blocks]
    block_table = table.view(num_reqs, max_blocks).to(torch.int32)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    value_cache = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    query = torch.randn(num_reqs * q_len, NUM_HEADS, HEAD_DIM, generator=gen, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return query.to(dtype), key_cache, value_cache, block_table, lens


def _sdpa_on_gathered(query, key_cache, value_cache, block_table, seq_lens, scale, q_len):
    out = torch.zeros_like(query)
    for req, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        k = gather_kv(key_cache, block_table, req, n).transpose(0, 1)[None]  # [1, kvh, n, d]
        v = gather_kv(value_cache, block_table, req, n).transpose(0, 1)[None]
        q = query[req * q_len : (req + 1) * q_len].transpose(0, 1)[None]  # [1, h, q_len, d]
        key_pos = torch.arange(n, device=DEVICE)
        mask = key_pos[None, :] <= (n - q_len + torch.arange(q_len, device=DEVICE))[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[req * q_len : (req + 1) * q_len] = o[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("num_reqs", [1, 8, 32])
@pytest.mark.parametrize("q_len", [1, 5])
def test_paged_attention_llama8b(num_reqs, q_len):
    gen = torch.Generator().manual_seed(num_reqs * 10 + q_len)
    seq_lens = torch.randint(q_len, 4097, (num_reqs,), generator=gen).tolist()
    if num_reqs > 1:
        seq_lens[-1] = 0  # a CUDA-graph padding request
    seq_lens[0] = max(seq_lens[0], q_len)
    query, key_cache, value_cache, block_table, lens = _paged_case(seq_lens, q_len)
    scale = HEAD_DIM**-0.5
    out = paged_attention(query, key_cache, value_cache, block_table, lens, scale, q_len)
    ref = paged_attention_reference(query, key_cache, value_cache, block_table, lens, scale, q_len)
    sdpa = _sdpa_on_gathered(query, key_cache, value_cache, block_table, lens, scale, q_len)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(out.float(), sdpa.float(), atol=2e-2, rtol=0)
    unsplit = paged_attention(
        query, key_cache, value_cache, block_table, lens, scale, q_len, num_splits=1
    )
    torch.testing.assert_close(out.float(), unsplit.float(), atol=2e-2, rtol=0)


def test_paged_attention_packs_kv_heads_at_batch_128(monkeypatch):
    """Batch-128 decode takes two KV heads a program by default (the launch is checked); it
    agrees with the reference and with one KV head a program."""
    from specula.runtime.kernels import paged_attention as module

    kernel, packs = module._paged_attention_kernel, []

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                packs.append(kwargs["PACK"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, "_paged_attention_kernel", Recording())
    gen = torch.Generator().manual_seed(128)
    seq_lens = torch.randint(1, 600, (128,), generator=gen).tolist()
    seq_lens[-1] = 0  # a CUDA-graph padding request
    query, key_cache, value_cache, block_table, lens = _paged_case(seq_lens, 1)
    scale = HEAD_DIM**-0.5
    out = paged_attention(query, key_cache, value_cache, block_table, lens, scale)
    ref = paged_attention_reference(query, key_cache, value_cache, block_table, lens, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)
    one = paged_attention(query, key_cache, value_cache, block_table, lens, scale, pack=1)
    torch.testing.assert_close(out.float(), one.float(), atol=2e-2, rtol=0)
    assert torch.all(out[-1] == 0) and packs == [2, 1]


@pytest.mark.parametrize("num_reqs, q_len", [(1, 1), (16, 1), (1, 5), (8, 5), (80, 1)])
def test_paged_attention_with_new_kv(num_reqs, q_len):
    """Rotary and the cache write inside attention (``new_kv``) against the rotary kernel
    and the attention after it: the same cache bit for bit, the same output within the
    tolerance. 80 requests: past four programs per SM, where the rotary kernel runs first."""
    gen = torch.Generator().manual_seed(num_reqs * 7 + q_len)
    seq_lens = torch.randint(q_len + 1, 3000, (num_reqs,), generator=gen).tolist()
    if num_reqs > 1:
        seq_lens[-1] = 0  # a CUDA-graph padding request
    query, key_cache, value_cache, block_table, lens = _paged_case(seq_lens, q_len, seed=3)
    n = num_reqs * q_len
    new = torch.randn(n, 2, NUM_KV_HEADS, HEAD_DIM, device=DEVICE).to(torch.bfloat16)
    key, value = new[:, 0], new[:, 1]
    positions = torch.tensor([max(s - q_len + j, 0) for s in seq_lens for j in range(q_len)],
                             device=DEVICE)
    slots = [int(block_table[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE if s else -1
             for r, s in enumerate(seq_lens) for p in range(max(s - q_len, 0), max(s - q_len, 0) + q_len)]
    slot_mapping = torch.tensor(slots, device=DEVICE)
    rope = RotaryEmbedding(HEAD_DIM, 500000.0, None, torch.device(DEVICE))
    cos_sin = build_cos_sin_cache(rope.inv_freq, 4096)
    scale = HEAD_DIM**-0.5
    q2, k2, kc2, vc2 = query.clone(), key.clone(), key_cache.clone(), value_cache.clone()
    rotary_embedding_and_cache(positions, q2, k2, value, kc2, vc2, slot_mapping, cos_sin)
    ref = paged_attention(q2, kc2, vc2, block_table, lens, scale, q_len)
    out = paged_attention(query, key_cache, value_cache, block_table, lens, scale, q_len,
                          new_kv=(key, value, positions, slot_mapping, cos_sin))
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)
    # Rotated keys within a bfloat16 unit (the two kernels may contract the float32
    # products into fused multiply-adds differently); values copied exactly.
    torch.testing.assert_close(key_cache.float(), kc2.float(), **BF16_TOL)
    assert torch.equal(value_cache, vc2)


@pytest.mark.parametrize("dtype, atol", [(torch.float16, 3e-3), (torch.float32, 1e-5)])
def test_paged_attention_other_dtypes(dtype, atol):
    query, key_cache, value_cache, block_table, lens = _paged_case([700, 33, 1500], 3, dtype)
    scale = HEAD_DIM**-0.5
    out = paged_attention(query, key_cache, value_cache, block_table, lens, scale, 3)
    ref = paged_attention_reference(query, key_cache, value_cache, block_table, lens, scale, 3)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


def test_reshape_and_cache_bf16():
    _, key_cache, value_cache, _, _ = _paged_case([64] * 4, 1)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    num_slots = key_cache.shape[0] * BLOCK_SIZE
    slots = torch.randperm(num_slots, device=DEVICE)[:300]
    slots[::7] = -1
    key = torch.randn(300, NUM_KV_HEADS, HEAD_DIM, device=DEVICE).to(torch.bfloat16)
    value = torch.randn_like(key)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    reshape_and_cache_reference(key, value, ref_k, ref_v, slots)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)


@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_bf16(gemma):
    torch.manual_seed(0)
    x = (torch.randn(67, HIDDEN, device=DEVICE) * 4).to(torch.bfloat16)
    residual = torch.randn_like(x)
    weight = (torch.randn(HIDDEN, device=DEVICE) * 0.2 + 1).to(torch.bfloat16)
    out = rms_norm(x, weight, 1e-5, gemma=gemma)
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-5, gemma=gemma)[0], **BF16_TOL)
    out, residual_out = fused_add_rms_norm(x, residual, weight, 1e-5, gemma=gemma)
    ref, ref_residual = rms_norm_reference(x, weight, 1e-5, gemma=gemma, residual=residual)
    assert torch.equal(residual_out, ref_residual)
    torch.testing.assert_close(out, ref, **BF16_TOL)


def test_rotary_bf16_llama3():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    rope = RotaryEmbedding(HEAD_DIM, 500000.0, scaling, torch.device(DEVICE))
    cache = build_cos_sin_cache(rope.inv_freq, 16384)
    torch.manual_seed(1)
    qkv = torch.randn(97, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, device=DEVICE).bfloat16()
    query, key = qkv[:, :NUM_HEADS], qkv[:, NUM_HEADS : NUM_HEADS + NUM_KV_HEADS]
    positions = torch.randint(0, 16384, (97,), device=DEVICE)
    ref_q, ref_k = rotary_embedding_reference(positions, query, key, cache)
    rotary_embedding(positions, query, key, cache)
    torch.testing.assert_close(query, ref_q, **BF16_TOL)
    torch.testing.assert_close(key, ref_k, **BF16_TOL)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_rejection_sample_matches_reference(with_draft_probs):
    gen = torch.Generator(DEVICE).manual_seed(0)
    num_draft = [4, 0, 2, 4, 1, 3, 4, 4] * 4
    num_reqs, total = len(num_draft), sum(num_draft)
    logits = torch.randn(total + num_reqs, VOCAB, generator=gen, device=DEVICE) * 4
    target_probs = logits.softmax(-1)
    draft_probs = (logits[: total] + torch.randn(total, VOCAB, generator=gen, device=DEVICE))
    draft_probs = draft_probs.softmax(-1)
    batch = dict(
        draft_token_ids=torch.multinomial(draft_probs, 1, generator=gen)[:, 0],
        cu_num_draft_tokens=torch.tensor(num_draft, device=DEVICE).cumsum(0).to(torch.int32),
        target_argmax=logits.argmax(-1),
        max_spec_len=4,
        is_greedy=torch.arange(num_reqs, device=DEVICE) % 3 == 0,
        draft_probs=draft_probs if with_draft_probs else None,
        target_probs=target_probs,
        uniform_samples=torch.rand(total, generator=gen, device=DEVICE),
        exponential_noise=torch.empty(num_reqs, VOCAB, device=DEVICE).exponential_(
            generator=gen
        ),
    )
    out, num_accepted = rejection_sample(**batch)
    ref_out, ref_accepted = rejection_sample_reference(**batch)
    assert torch.equal(out, ref_out) and torch.equal(num_accepted, ref_accepted)
    greedy_out, _ = rejection_sample(
        batch["draft_token_ids"], batch["cu_num_draft_tokens"], batch["target_argmax"], 4
    )
    ref_greedy, _ = rejection_sample_reference(
        batch["draft_token_ids"], batch["cu_num_draft_tokens"], batch["target_argmax"], 4
    )
    assert torch.equal(greedy_out, ref_greedy)


def test_rejection_sample_agrees_with_reference_at_a_llama3_vocabulary():
    """The kernel and its torch reference on the engine's counter-based draws (one
    request's uniforms and noise from its seed), at a Llama-3 vocabulary."""
    num_reqs, k = 16, 4
    gen = torch.Generator(DEVICE).manual_seed(3)
    target_logits = torch.randn(num_reqs, k + 1, VOCAB, generator=gen, device=DEVICE) * 3
    draft_probs = (target_logits[:, :k] + torch.randn(num_reqs, k, VOCAB, generator=gen,
                   device=DEVICE)).softmax(-1)
    drafts = torch.multinomial(draft_probs.view(-1, VOCAB), 1, generator=gen).view(num_reqs, k)
    params = [SamplingParams(temperature=[0.0, 1.0, 0.7, 1.2][i % 4], seed=i) for i in range(16)]
    sampling = SamplingMetadata.from_params(params, [p.seed for p in params], torch.device(DEVICE))
    keys = torch.arange(num_reqs, device=DEVICE) + 100
    args = (
        drafts.flatten(),
        torch.arange(1, num_reqs + 1, dtype=torch.int32, device=DEVICE) * k,
        target_logits.argmax(-1).flatten(),
        k,
    )
    kwargs = dict(
        is_greedy=sampling.is_greedy,
        draft_probs=draft_probs.flatten(0, 1),
        target_probs=compute_probs(target_logits, sampling).flatten(0, 1),
        uniform_samples=random_uniform(sampling.seeds, keys, 1, k).flatten(),
        exponential_noise=random_exponential(sampling.seeds, keys, 0, VOCAB),
    )
    out, num_accepted = rejection_sample(*args, **kwargs)
    expected = rejection_sample_reference(*args, **kwargs)
    assert torch.equal(out, expected[0]) and torch.equal(num_accepted, expected[1])
    assert 0 < int(num_accepted.sum()) < num_reqs * k


def test_prepare_draft_inputs_matches_reference():
    gen = torch.Generator().manual_seed(0)
    num_reqs, k = 64, 4
    num_draft = torch.randint(0, k + 1, (num_reqs,), generator=gen)
    num_draft[::5] = 0
    prefill_lens = torch.randint(1, 300, (num_reqs,), generator=gen)
    lens = torch.where(num_draft > 0, num_draft + 1, prefill_lens)
    accepted = (torch.rand(num_reqs, generator=gen) * (num_draft + 1)).long().clamp_max(num_draft)
    total = int(lens.sum())
    args = (
        torch.randint(0, VOCAB, (total,), generator=gen),
        torch.cat([torch.arange(n) + 11 for n in lens.tolist()]),
        torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32),
        num_draft.cumsum(0).to(torch.int32),
        accepted,
        torch.randint(0, VOCAB, (num_reqs,), generator=gen),
    )
    args = tuple(a.to(DEVICE) for a in args)
    got, want = prepare_draft_inputs(*args), prepare_draft_inputs_reference(*args)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_verification_step_in_a_cuda_graph():
    """Cache write, verification attention, greedy verification and draft-input
    preparation captured once, replayed with other lengths, slots and tokens: no host
    synchronisation anywhere (capture would fail), same results as eager."""
    num_reqs, k = 4, 3
    q_len = k + 1
    max_blocks = 64
    num_blocks = num_reqs * max_blocks
    key_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    key_cache = key_cache.bfloat16()
    value_cache = torch.zeros_like(key_cache)
    block_table = torch.randperm(num_blocks, device=DEVICE).view(num_reqs, max_blocks).int()
    # Static inputs of the graph.
    seq_lens = torch.zeros(num_reqs, dtype=torch.int32, device=DEVICE)
    slot_mapping = torch.zeros(num_reqs * q_len, dtype=torch.int64, device=DEVICE)
    query = torch.zeros(num_reqs * q_len, NUM_HEADS, HEAD_DIM, device=DEVICE).bfloat16()
    new_k = torch.zeros(num_reqs * q_len, NUM_KV_HEADS, HEAD_DIM, device=DEVICE).bfloat16()
    new_v = torch.zeros_like(new_k)
    input_ids = torch.zeros(num_reqs * q_len, dtype=torch.int64, device=DEVICE)
    positions = torch.zeros_like(input_ids)
    target_argmax = torch.zeros(num_reqs * q_len, dtype=torch.int64, device=DEVICE)
    cu_draft = torch.arange(1, num_reqs + 1, dtype=torch.int32, device=DEVICE) * k
    query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32, device=DEVICE) * q_len
    draft_ids = input_ids.view(num_reqs, q_len)[:, 1:]

    def step():
        reshape_and_cache(new_k, new_v, key_cache, value_cache, slot_mapping)
        attn = paged_attention(query, key_cache, value_cache, block_table, seq_lens, 0.1, q_len)
        out, num_accepted = rejection_sample(draft_ids.flatten(), cu_draft, target_argmax, k)
        next_ids = out.gather(1, num_accepted[:, None])[:, 0]
        draft = prepare_draft_inputs(
            input_ids, positions, query_start_loc, cu_draft, num_accepted, next_ids
        )
        return attn, out, num_accepted, *draft

    def fill(seed: int):
        gen = torch.Generator().manual_seed(seed)
        lens = torch.randint(q_len, max_blocks * BLOCK_SIZE, (num_reqs,), generator=gen)
        seq_lens.copy_(lens)
        pos = torch.cat([torch.arange(n - q_len, n) for n in lens.tolist()])
        req = torch.arange(num_reqs).repeat_interleave(q_len)
        blocks = block_table.cpu()[req, pos // BLOCK_SIZE].long()
        slot_mapping.copy_(blocks * BLOCK_SIZE + pos % BLOCK_SIZE)
        positions.copy_(pos)
        for t in (query, new_k, new_v):
            t.copy_(torch.randn(t.shape, generator=gen))
        key_cache.copy_(torch.randn(key_cache.shape, generator=gen))
        value_cache.copy_(torch.randn(value_cache.shape, generator=gen))
        ids = torch.randint(0, 50, (num_reqs * q_len,), generator=gen)
        input_ids.copy_(ids)
        # The target agrees with a random-length prefix of each draft.
        argmax = torch.randint(50, 100, (num_reqs, q_len), generator=gen)
        agree = torch.randint(0, q_len, (num_reqs,), generator=gen)
        for r in range(num_reqs):
            argmax[r, : agree[r]] = ids.view(num_reqs, q_len)[r, 1 : 1 + agree[r]]
        target_argmax.copy_(argmax.flatten())

    fill(0)
    step()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (1, 2):
        fill(seed)
        cache_before = (key_cache.clone(), value_cache.clone())
        graph.replay()
        replayed = [t.clone() for t in captured]
        key_cache.copy_(cache_before[0])
        value_cache.copy_(cache_before[1])
        eager = step()
        torch.testing.assert_close(replayed[0], eager[0], atol=0, rtol=0)
        for got, want in zip(replayed[1:], eager[1:], strict=True):
            assert torch.equal(got, want)


def test_random_draws_match_references():
    from specula.runtime.kernels.random import (
        MODE_BITS,
        MODE_EXPONENTIAL,
        MODE_UNIFORM,
        random_draws,
        random_draws_reference,
    )
    gen = torch.Generator().manual_seed(5)
    seeds = torch.cat([torch.randint(0, 2**62, (30,), generator=gen), torch.tensor([-1, -(2**40)])])
    keys = torch.randint(0, 2**32, (32,), generator=gen)
    s, k = seeds.to(DEVICE), keys.to(DEVICE)
    for mode in (MODE_BITS, MODE_UNIFORM, MODE_EXPONENTIAL):
        for stream, cols in ((0, 5), (2, VOCAB), (3, 128256)):
            got = random_draws(s, k, stream, cols, mode).cpu()
            ref = random_draws_reference(seeds, keys, stream, cols, mode)
            tol = 1e-5 if mode == MODE_EXPONENTIAL else 0.0
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def test_gemv_matches_the_library_gemm_on_tuned_shapes():
    from specula.runtime.kernels.gemv import CONFIGS, block_m, gemv, linear, use_gemv

    gen = torch.Generator(DEVICE).manual_seed(0)
    for (n, k), tiles in CONFIGS.items():
        w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 0.02
        for rows in sorted({1, 5, *(t // 2 + 1 for t in tiles), *tiles}):
            x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16, generator=gen)
            if not use_gemv(x, w):  # a row tile where the library GEMM was faster
                assert block_m(rows) not in tiles
                continue
            ref = F.linear(x.float(), w.float())
            for y in (gemv(x, w), linear(x, w)):
                assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
        assert not use_gemv(torch.randn(200, k, device=DEVICE, dtype=torch.bfloat16), w)


def test_linear_takes_cublaslt_on_its_rows_and_restores_the_preference(monkeypatch):
    from specula.runtime.kernels.gemv import LT_ROWS, linear

    asked, choose = [], torch.backends.cuda.preferred_blas_library
    before = choose()
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library",
                        lambda backend=None: asked.append(backend) or choose(backend))
    gen = torch.Generator(DEVICE).manual_seed(0)
    for (n, k), (low, high) in LT_ROWS.items():
        w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 0.02
        for rows, lt in ((low - 1, False), (low, True), (high, True), (high + 1, False)):
            x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16, generator=gen)
            asked.clear()
            y = linear(x, w)
            ref = F.linear(x.float(), w.float())
            assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
            assert ("cublaslt" in asked) == lt and choose() == before
    # The preference comes back when the product raises, too.
    low = next(iter(LT_ROWS.values()))[0]
    n, k = next(iter(LT_ROWS))
    x = torch.randn(low, k, device=DEVICE, dtype=torch.bfloat16)
    monkeypatch.setattr(F, "linear", lambda *args: (_ for _ in ()).throw(RuntimeError("no GEMM")))
    with pytest.raises(RuntimeError, match="no GEMM"):
        linear(x, torch.zeros(n, k, device=DEVICE, dtype=torch.bfloat16))
    assert choose() == before


@pytest.mark.parametrize("split", [2, 4])
def test_split_k_gemv_in_a_cuda_graph(split, monkeypatch):
    """Split-K on a short, wide weight (the 1B ``down_proj``): equal to the unsplit GEMV
    up to the float32 sums' order, the same result launch after launch, eagerly and
    replayed in a CUDA graph (each column tile's counter set back by its last program),
    and with the residual epilogue."""
    from specula.runtime.kernels import gemv as kernels
    from specula.runtime.kernels.gemv import gemv

    counters = kernels._split_counts  # every launch below takes the split
    taken: list = []
    monkeypatch.setattr(kernels, "_split_counts",
                        lambda device, grid: taken.append(counters(device, grid)) or taken[-1])
    gen = torch.Generator(DEVICE).manual_seed(split)
    w = torch.randn(2048, 8192, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 0.02
    for rows in (1, 5):
        x = torch.randn(rows, 8192, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        residual = torch.randn(rows, 2048, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        cfg = (16, 256, 4, 5, split)
        want = gemv(x, w, cfg)
        torch.testing.assert_close(want, gemv(x, w, (16, 256, 4, 5)), rtol=1e-2, atol=1e-2)
        stream, _ = gemv(x, w, cfg, residual=residual)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [gemv(x, w, cfg) for _ in range(20)]
        for _ in range(10):
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(y, want) for y in outs)
        assert torch.equal(stream, (want.float() + residual.float()).to(torch.bfloat16))
    assert len(taken) == 2 * 22 and all(c is not None for c in taken)


def test_gemv_prefetch_changes_no_result():
    """``prefetch`` only asks L2 for the next weight's first lines: the plain product, the
    SwiGLU epilogue and the split-K residual epilogue (the 1B ``down_proj``) give the same
    bits with it, eagerly and replayed in a CUDA graph."""
    from specula.runtime.kernels.dispatch import pdl
    from specula.runtime.kernels.gemv import gemv, prefetch_lines

    gen = torch.Generator(DEVICE).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 0.02

    x, x_wide, res, nxt = randn(5, 2048), randn(5, 8192), randn(5, 2048), randn(3072, 2048)
    o, gate_up, down = randn(2048, 2048), randn(16384, 2048), randn(2048, 8192)
    # Each case below launches the prefetching variant (PREFETCH: lines > 0 on a PDL device).
    assert pdl(x) and all(prefetch_lines(w, nxt) > 0 for w in (o, gate_up, down))
    cases = [lambda p: gemv(x, o, prefetch=p), lambda p: gemv(x, gate_up, silu_mul=True, prefetch=p),
             lambda p: gemv(x_wide, down, residual=res, prefetch=p)[0]]
    want = [case(None) for case in cases]
    assert all(torch.equal(case(nxt), w) for case, w in zip(cases, want, strict=True))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [case(nxt) for case in cases]
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(y, w) for y, w in zip(outs, want, strict=True))


@pytest.mark.parametrize("rows", [1, 5, 32, 64])
def test_gate_up_gemv_with_swiglu_epilogue(rows):
    from specula.runtime.kernels.activation import silu_and_mul
    from specula.runtime.kernels.gemv import gemv, linear_silu_and_mul

    gen = torch.Generator(DEVICE).manual_seed(rows)
    w = torch.randn(28672, HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 0.02
    x = torch.randn(rows, HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    fused = linear_silu_and_mul(x, w)
    assert fused.shape == (rows, 14336) and fused.dtype == torch.bfloat16
    # Same accumulation as the plain GEMV, then the activation kernel's rounding.
    torch.testing.assert_close(fused, silu_and_mul(gemv(x, w)), **BF16_TOL)
    ref = silu_and_mul(F.linear(x.float(), w.float()))
    assert ((fused.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("hidden", [HIDDEN, 2048])
def test_screened_argmax_matches_the_unscreened_argmax(hidden):
    """bfloat16 on the GPU (the interpreted test takes float16): every logit bounded, few
    candidates, and the first argmax of the logits rounded to bfloat16, with a tie across
    programs and rows that nearly tie."""
    from specula.runtime.kernels.gemv import SCREEN_CONFIG, gemv, screen_weight, screened_argmax

    gen = torch.Generator(DEVICE).manual_seed(hidden)
    w = torch.randn(VOCAB, hidden, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 0.02
    w[VOCAB - 5] = w[3]
    w[4000:4040] = w[3] * (1 - 2**-9 * torch.rand(40, 1, device=DEVICE, generator=gen)).bfloat16()
    q, aux = screen_weight(w)
    for rows in (1, 2, 5, 16, 24, 32):  # 17-32 rows: the 32-row tile
        x = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        x[0] = w[3] * 50
        centre, top, top_bound = gemv(x, q, SCREEN_CONFIG, screen=aux)
        col = centre.unflatten(1, (-1, SCREEN_CONFIG[0])).argmax(-1)  # each program's best centre
        col += torch.arange(0, VOCAB, SCREEN_CONFIG[0], device=DEVICE)
        assert torch.equal(top, centre.gather(1, col)) and torch.equal(top_bound, aux[1][col])
        norm, bound = x.double().norm(dim=1, keepdim=True), aux[1].double()
        exact = x.double() @ w.double().T
        assert ((centre.double() - exact).abs() <= norm * bound).all()
        upper, lower = centre.double() + norm * bound, top.double() - norm * top_bound.double()
        assert (lower <= exact.gather(1, col)).all()
        candidates = (upper.bfloat16() >= lower.amax(1, keepdim=True).bfloat16()).sum(1)
        assert (candidates[1:] < 1000).all() and candidates[0] >= 2  # row 0: w[3]'s copies tie
        into = torch.empty(rows, dtype=torch.int64, device=DEVICE)
        assert screened_argmax(x, w, (q, aux), into) is into
        assert torch.equal(into, exact.bfloat16().argmax(-1)) and int(into[0]) == 3


@pytest.mark.parametrize("vocab", [VOCAB, 32000])
def test_lm_head_gemv_with_argmax_epilogue(vocab):
    from specula.runtime.kernels.gemv import gemv, linear_argmax, use_gemv

    gen = torch.Generator(DEVICE).manual_seed(vocab)
    w = torch.randn(vocab, HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 0.02
    w[vocab - 5] = w[3]  # a tie across programs: the first index wins
    for rows in (1, 7, 64, 128, 160):
        x = torch.randn(rows, HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        x[0] = w[3] * 50
        logits, idx = linear_argmax(x, w)
        assert idx.dtype == torch.int64 and idx.shape == (rows,) and int(idx[0]) == 3
        assert torch.equal(idx, logits.argmax(-1))
        if use_gemv(x, w):
            assert torch.equal(logits, gemv(x, w))  # the epilogue leaves the logits as they were
        ref = F.linear(x.float(), w.float())
        assert ((logits.float() - ref).norm() / ref.norm()).item() < 1e-2
