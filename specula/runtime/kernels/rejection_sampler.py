"""Rejection sampling of draft tokens on the GPU, greedy and random, in one kernel
(:func:`rejection_sample`; Leviathan et al., arXiv 2211.17192; Chen et al., arXiv
2302.01318), with the random draws made by the caller so that the kernel is deterministic
given them, and what a step keeps of it in another (:func:`accepted_tokens`):

- greedy request: accept draft tokens while each equals the target argmax (in benchmarks,
  vLLM's ``rejection_sample_method="synthetic"``, while each one's uniform draw is below a
  rate); then emit the target argmax at the first mismatch (or the bonus position);
- random request: accept draft token ``x_j`` while ``u_j * q_j(x_j) < p_j(x_j)`` (that is
  ``u_j < p/q``, without dividing); at the first rejection ``a`` emit the recovered token
  ``argmax(max(p_a - q_a, 0) / e)`` with ``e ~ Exp(1)`` per vocabulary entry (the
  exponential race, which samples from the normalised residual); after ``k`` acceptances
  ``q`` is 0 and the same formula samples the bonus token from ``p_{k+1}``. A residual
  that is all zero (``p == q``, probability-zero rejection) falls back to ``p``.

Batch layout follows vLLM's rejection sampler (``vllm/v1/sample/rejection_sampler.py``): draft
tokens flattened over requests with ``cu_num_draft_tokens`` (inclusive cumulative counts, so
requests may draft different numbers of tokens); target rows flattened with one extra (bonus) row
per request; output ``[num_reqs, max_spec_len + 1]`` padded with :data:`PLACEHOLDER_TOKEN_ID`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specula.runtime.kernels.dispatch import use_reference

PLACEHOLDER_TOKEN_ID = -1
"""Fills output positions after the first rejection (vLLM's value)."""

_BLOCK_V = 2048
"""Vocabulary entries per step of the recovered-token scan."""


@triton.jit
def _race(weight, e, valid, v0, best, best_idx):
    """One chunk ``v0 + [0, BLOCK_V)`` of the exponential race ``argmax(weight / e)``:
    the running ``(best, best_idx)`` updated with the chunk's winner.

    IEEE division (``/`` may compile to an approximate one) so that the race picks the token torch
    picks; strictly greater across chunks keeps the first index of a tie, as torch.argmax does."""
    val, idx = tl.max(
        tl.where(valid, tl.math.div_rn(weight, e), float("-inf")), axis=0, return_indices=True)
    better = val > best
    best_idx = tl.where(better, v0 + idx, best_idx)
    return tl.where(better, val, best), best_idx


@triton.jit
def _rejection_sample_kernel(
    output_ptr,  # [num_reqs, max_spec_len + 1] int64
    num_accepted_ptr,  # [num_reqs] int64
    draft_token_ids_ptr,  # [num_draft_tokens] int64
    cu_num_draft_tokens_ptr,  # [num_reqs] int32
    target_argmax_ptr,  # [num_draft_tokens + num_reqs] int64
    is_greedy_ptr,  # [num_reqs] bool
    draft_probs_ptr,  # [num_draft_tokens, vocab_size] float32
    target_probs_ptr,  # [num_draft_tokens + num_reqs, vocab_size] float32
    uniform_ptr,  # [num_draft_tokens] float32
    noise_ptr,  # [num_reqs, vocab_size] float32
    vocab_size, stride_out, stride_draft_probs, stride_target_probs, stride_noise, rate,
    MAX_SPEC_LEN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    ALL_GREEDY: tl.constexpr, NO_DRAFT_PROBS: tl.constexpr, PLACEHOLDER: tl.constexpr,
    SYNTHETIC: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.load(cu_num_draft_tokens_ptr + req - 1, mask=req > 0, other=0)
    num_draft = tl.load(cu_num_draft_tokens_ptr + req) - start
    target_row0 = start + req  # request req's first target row
    offs_k = tl.arange(0, BLOCK_K)
    valid = offs_k < num_draft
    tokens = tl.load(draft_token_ids_ptr + start + offs_k, mask=valid, other=0)
    argmax = tl.load(target_argmax_ptr + target_row0 + offs_k, mask=valid, other=-1)
    accepted = tokens == argmax
    if SYNTHETIC:
        accepted = tl.load(uniform_ptr + start + offs_k, mask=valid, other=1.0) < rate
    if not ALL_GREEDY:
        greedy = tl.load(is_greedy_ptr + req).to(tl.int32)
        # Draft positions whose probabilities a random request reads (none when greedy).
        sampled = offs_k < tl.where(greedy != 0, 0, num_draft)
        rows = (target_row0 + offs_k).to(tl.int64)
        p = tl.load(target_probs_ptr + rows * stride_target_probs + tokens, mask=sampled, other=0.0)
        if NO_DRAFT_PROBS:
            q = tl.full([BLOCK_K], 1.0, tl.float32)
        else:
            draft_rows = (start + offs_k).to(tl.int64)
            q = tl.load(
                draft_probs_ptr + draft_rows * stride_draft_probs + tokens, mask=sampled, other=0.0)
        u = tl.load(uniform_ptr + start + offs_k, mask=sampled, other=1.0)
        accepted = tl.where(greedy != 0, accepted, u * q < p)
    num_acc = tl.min(tl.where(valid & (accepted == 0), offs_k, num_draft), axis=0)
    final = tl.load(target_argmax_ptr + target_row0 + num_acc)
    if not ALL_GREEDY:
        if greedy == 0:
            # The residual of position num_acc; at the bonus position q is 0.
            row = (target_row0 + num_acc).to(tl.int64)
            has_draft = num_acc < num_draft
            draft_tok = tl.load(draft_token_ids_ptr + start + num_acc, mask=has_draft, other=-1)
            draft_row = (start + num_acc).to(tl.int64)
            best_res = tl.full([], float("-inf"), tl.float32)
            best_res_idx = tl.zeros([], tl.int32)
            best_p = tl.full([], float("-inf"), tl.float32)
            best_p_idx = tl.zeros([], tl.int32)
            res_any = tl.zeros([], tl.int1)
            for v0 in range(0, vocab_size, BLOCK_V):
                offs_v = v0 + tl.arange(0, BLOCK_V)
                v_valid = offs_v < vocab_size
                p_v = tl.load(
                    target_probs_ptr + row * stride_target_probs + offs_v, mask=v_valid, other=0.0)
                if NO_DRAFT_PROBS:
                    q_v = tl.where(offs_v == draft_tok, 1.0, 0.0)
                else:
                    q_v = tl.load(
                        draft_probs_ptr + draft_row * stride_draft_probs + offs_v,
                        mask=offs_v < tl.where(has_draft, vocab_size, 0), other=0.0)
                e_v = tl.load(noise_ptr + req * stride_noise + offs_v, mask=v_valid, other=1.0)
                residual = tl.maximum(p_v - q_v, 0.0)
                res_any = res_any | (tl.max(residual, axis=0) > 0.0)
                best_res, best_res_idx = _race(residual, e_v, v_valid, v0, best_res, best_res_idx)
                best_p, best_p_idx = _race(p_v, e_v, v_valid, v0, best_p, best_p_idx)
            final = tl.where(res_any, best_res_idx, best_p_idx).to(tl.int64)
    out = tl.where(offs_k < num_acc, tokens, tl.where(offs_k == num_acc, final, PLACEHOLDER))
    tl.store(output_ptr + req * stride_out + offs_k, out, mask=offs_k < MAX_SPEC_LEN + 1)
    tl.store(num_accepted_ptr + req, num_acc.to(tl.int64))


def rejection_sample(
    draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor, target_argmax: torch.Tensor,
    max_spec_len: int, *, is_greedy: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None, target_probs: torch.Tensor | None = None,
    uniform_samples: torch.Tensor | None = None, exponential_noise: torch.Tensor | None = None,
    synthetic_acceptance_rate: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify each request's draft tokens; no host synchronisation.

    Args:
        draft_token_ids: [num_draft_tokens] int64, request-major.
        cu_num_draft_tokens: [num_reqs] int32, inclusive cumulative draft counts; each
            request drafts at most ``max_spec_len`` tokens.
        target_argmax: [num_draft_tokens + num_reqs] int64, argmax of the raw target
            logits; request ``i``'s ``n_i + 1`` rows start at ``cu_num_draft_tokens[i-1] + i``.
        max_spec_len: the output has ``max_spec_len + 1`` columns.
        is_greedy: [num_reqs] bool; ``None`` means every request is greedy, and the
            remaining arguments are then ignored.
        draft_probs: [num_draft_tokens, vocab_size] float32, the distributions the draft
            tokens were sampled from; ``None`` for deterministic drafts (n-gram), treated
            as one-hot on the draft token.
        target_probs: [num_draft_tokens + num_reqs, vocab_size] float32, the processed
            (temperature, top-k, top-p) target distributions, rows as ``target_argmax``.
        uniform_samples: [num_draft_tokens] float32 in [0, 1), one per draft token.
        exponential_noise: [num_reqs, vocab_size] float32, positive Exp(1) draws used for
            each request's recovered or bonus token.
        synthetic_acceptance_rate: with every request greedy and ``uniform_samples``,
            accept each draft while its draw is below this rate (module docstring).

    Returns:
        ``(output_token_ids [num_reqs, max_spec_len + 1] int64, num_accepted [num_reqs]
        int64)``: row ``i`` holds ``num_accepted[i]`` draft tokens, the recovered or bonus
        token, then :data:`PLACEHOLDER_TOKEN_ID`.

    Raises:
        AssertionError: shapes, dtypes or layouts do not match the above.
    """
    assert draft_token_ids.ndim == 1 and draft_token_ids.dtype == torch.int64
    assert cu_num_draft_tokens.ndim == 1 and cu_num_draft_tokens.dtype == torch.int32
    assert target_argmax.dtype == torch.int64 and max_spec_len >= 1
    assert draft_token_ids.is_contiguous() and cu_num_draft_tokens.is_contiguous()
    num_draft_tokens, num_reqs = draft_token_ids.shape[0], cu_num_draft_tokens.shape[0]
    num_rows = num_draft_tokens + num_reqs
    assert target_argmax.shape == (num_rows,) and target_argmax.is_contiguous()
    output = draft_token_ids.new_empty(num_reqs, max_spec_len + 1)
    num_accepted = draft_token_ids.new_empty(num_reqs)
    if num_reqs == 0:
        return output, num_accepted
    all_greedy = is_greedy is None
    synthetic = synthetic_acceptance_rate is not None
    u = uniform_samples
    assert not synthetic or (all_greedy and u is not None and u.shape == (num_draft_tokens,)
                             and u.dtype == torch.float32 and u.is_contiguous())
    if not all_greedy:
        assert is_greedy.shape == (num_reqs,) and is_greedy.dtype == torch.bool
        assert target_probs is not None and uniform_samples is not None
        assert exponential_noise is not None and target_probs.ndim == 2
        vocab_size = target_probs.shape[1]
        assert target_probs.shape[0] == num_rows and target_probs.dtype == torch.float32
        assert uniform_samples.shape == (num_draft_tokens,) and uniform_samples.is_contiguous()
        assert uniform_samples.dtype == exponential_noise.dtype == torch.float32
        assert exponential_noise.shape == (num_reqs, vocab_size)
        assert target_probs.stride(-1) == 1 and exponential_noise.stride(-1) == 1
        if draft_probs is not None:
            assert draft_probs.shape == (num_draft_tokens, vocab_size)
            assert draft_probs.dtype == torch.float32 and draft_probs.stride(-1) == 1
    if use_reference(draft_token_ids):
        return rejection_sample_reference(
            draft_token_ids, cu_num_draft_tokens, target_argmax, max_spec_len,
            is_greedy=is_greedy, draft_probs=draft_probs, target_probs=target_probs,
            uniform_samples=uniform_samples, exponential_noise=exponential_noise,
            synthetic_acceptance_rate=synthetic_acceptance_rate)
    # Arguments the kernel does not read (all greedy, or no draft probabilities) still
    # need a tensor: any will do, with row stride 0.
    sampling = (is_greedy, draft_probs, target_probs, uniform_samples, exponential_noise)
    if all_greedy:
        sampling = (None, None, None, uniform_samples if synthetic else None, None)
    pointers = [draft_token_ids if t is None else t for t in sampling]
    _, draft_probs_stride, target_probs_stride, _, noise_stride = [
        0 if t is None else t.stride(0) for t in sampling]
    _rejection_sample_kernel[(num_reqs,)](
        output, num_accepted, draft_token_ids, cu_num_draft_tokens, target_argmax, *pointers,
        0 if all_greedy else vocab_size, output.stride(0), draft_probs_stride, target_probs_stride,
        noise_stride, synthetic_acceptance_rate or 0.0, MAX_SPEC_LEN=max_spec_len,
        BLOCK_K=triton.next_power_of_2(max_spec_len + 1), BLOCK_V=_BLOCK_V, ALL_GREEDY=all_greedy,
        NO_DRAFT_PROBS=draft_probs is None, PLACEHOLDER=PLACEHOLDER_TOKEN_ID, SYNTHETIC=synthetic,
        # The vocabulary scan of random requests is the heavy part: give it 8 warps.
        num_warps=1 if all_greedy else 8,
        # Plain IEEE float32 arithmetic, so that the result is the torch reference's.
        enable_fp_fusion=False)
    return output, num_accepted


def rejection_sample_reference(
    draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor, target_argmax: torch.Tensor,
    max_spec_len: int, *, is_greedy: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None, target_probs: torch.Tensor | None = None,
    uniform_samples: torch.Tensor | None = None, exponential_noise: torch.Tensor | None = None,
    synthetic_acceptance_rate: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`rejection_sample` (same arguments and results), one
    request at a time."""
    num_reqs = cu_num_draft_tokens.shape[0]
    output = draft_token_ids.new_full((num_reqs, max_spec_len + 1), PLACEHOLDER_TOKEN_ID)
    num_accepted = draft_token_ids.new_zeros(num_reqs)
    ends = cu_num_draft_tokens.tolist()
    for req, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        tokens = draft_token_ids[start:end]
        rows = slice(start + req, end + req + 1)  # n + 1 target rows
        greedy = is_greedy is None or bool(is_greedy[req])
        if synthetic_acceptance_rate is not None:
            accepted = uniform_samples[start:end] < synthetic_acceptance_rate
        elif greedy:
            accepted = tokens == target_argmax[rows][:-1]
        else:
            p_rows = target_probs[rows]  # [n + 1, vocab_size]
            q_rows = (torch.nn.functional.one_hot(tokens, p_rows.shape[1]).float()
                      if draft_probs is None else draft_probs[start:end])  # [n, vocab_size]
            p = p_rows[:-1].gather(1, tokens[:, None])[:, 0]
            q = q_rows.gather(1, tokens[:, None])[:, 0]
            accepted = uniform_samples[start:end] * q < p
        n_acc = int(accepted.long().cumprod(0).sum())
        if greedy:
            final = target_argmax[rows][n_acc]
        else:
            q_sel = q_rows[n_acc] if n_acc < end - start else torch.zeros_like(p_rows[0])
            residual = (p_rows[n_acc] - q_sel).clamp_min(0)
            if residual.sum() <= 0:
                residual = p_rows[n_acc]
            final = (residual / exponential_noise[req]).argmax()
        output[req, :n_acc] = tokens[:n_acc]
        output[req, n_acc] = final
        num_accepted[req] = n_acc
    return output, num_accepted


@triton.jit
def _accepted_tokens_kernel(
    staged_ptr,  # [2 + width, num_reqs] int64 (the transpose of what the host reads)
    next_ptr, committed_ptr,  # [num_reqs] int64
    output_ptr,  # [num_reqs, width] int64
    raw_ptr,  # [num_decode] int64
    num_draft_ptr, idx_ptr, keys_ptr,  # [max rows], [num_reqs], [num_reqs] int64
    num_decode, k, width, stride_out, stride_col, HAS_RAW: tl.constexpr, BLOCK_W: tl.constexpr,
):
    req = tl.program_id(0)
    decode = req < num_decode
    row = tl.load(idx_ptr + req, mask=decode, other=0)
    verified = tl.minimum(tl.load(num_draft_ptr + row, mask=decode, other=0), k)
    accepted = verified * 0
    if HAS_RAW:
        accepted = tl.minimum(tl.load(raw_ptr + req, mask=decode, other=0), verified)
    offs = tl.arange(0, BLOCK_W)
    tokens = tl.load(output_ptr + req * stride_out + offs * stride_col, mask=offs < width, other=0)
    n = tl.num_programs(0)
    tl.store(staged_ptr + (2 + offs) * n + req, tokens, mask=offs < width)
    tl.store(staged_ptr + req, accepted)
    tl.store(staged_ptr + n + req, verified)
    tl.store(next_ptr + req, tl.sum(tl.where(offs == accepted, tokens, 0), axis=0))
    tl.store(committed_ptr + req, tl.load(keys_ptr + req) + accepted)


def accepted_tokens(output: torch.Tensor, num_accepted: torch.Tensor | None,
                    num_draft_tokens: torch.Tensor, idx: torch.Tensor, keys: torch.Tensor, k: int,
                    num_decode: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a step keeps of its verification, in one launch: its first ``num_decode``
    requests verified at most ``k`` drafts, but no more than their rows' real drafts (an
    n-gram proposal may be short); the rest prefilled and verified none.

    Args:
        output: [num_reqs, width] int64 (any strides) tokens per request, :func:`rejection_sample`'s
            ``output_token_ids`` (then each prefill's first token in column 0).
        num_accepted: [num_decode] int64, :func:`rejection_sample`'s; ``None``: none accepted.
        num_draft_tokens: [max_num_reqs] int64 real drafts per input-batch row.
        idx: [num_reqs] int64 input-batch rows; keys: [num_reqs] int64 positions of each
            request's first new token (a prefill's: its prompt length).

    Returns:
        ``(staged [num_reqs, 2 + width] int64, next_token_ids [num_reqs] int64, committed [num_reqs]
        int64)``: ``staged`` holds per request the accepted and the verified counts, then
        ``output``'s row (the step's one device-to-host copy; stored column by column, so that
        ``staged[:, 0]`` is contiguous); ``next_token_ids`` the token after the accepted ones,
        ``committed`` ``keys`` plus the accepted count.

    Raises:
        AssertionError: shapes or dtypes that do not match the above.
    """
    n, width = output.shape
    assert output.dtype == num_draft_tokens.dtype == idx.dtype == keys.dtype == torch.int64
    assert idx.shape == keys.shape == (n,) and 0 <= num_decode <= n and 0 <= k < width
    raw = output if num_accepted is None else num_accepted
    assert raw.dtype == torch.int64 and (num_accepted is None or raw.shape == (num_decode,))
    assert all(t.is_contiguous() for t in (idx, keys, num_draft_tokens, raw) if t is not output)
    if use_reference(output):
        return accepted_tokens_reference(output, num_accepted, num_draft_tokens, idx, keys, k,
                                         num_decode)
    staged = output.new_empty(2 + width, n).t()
    next_token_ids, committed = output.new_empty(n), output.new_empty(n)
    if n:
        _accepted_tokens_kernel[(n,)](
            staged, next_token_ids, committed, output, raw, num_draft_tokens, idx, keys,
            num_decode, k, width, output.stride(0), output.stride(1),
            HAS_RAW=num_accepted is not None, BLOCK_W=triton.next_power_of_2(width), num_warps=1)
    return staged, next_token_ids, committed


def accepted_tokens_reference(
    output: torch.Tensor, num_accepted: torch.Tensor | None, num_draft_tokens: torch.Tensor,
    idx: torch.Tensor, keys: torch.Tensor, k: int, num_decode: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`accepted_tokens` (same arguments and results)."""
    verified = torch.zeros_like(keys)
    verified[:num_decode] = num_draft_tokens[idx[:num_decode]].clamp(max=k)
    accepted = torch.zeros_like(keys)
    if num_accepted is not None:
        accepted[:num_decode] = torch.minimum(num_accepted, verified[:num_decode])
    staged = torch.cat([accepted[None], verified[None], output.t()]).t()
    return staged, output.gather(1, accepted[:, None])[:, 0], keys + accepted
