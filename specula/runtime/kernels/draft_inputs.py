"""Inputs of the draft's first forward after a verification step, built on the device.

EAGLE-style drafting (Li et al., arXiv 2401.15077; vLLM's ``EagleProposer.propose`` and
``prepare_inputs_padded`` / ``prepare_next_token_ids_padded``) runs the draft over the
same token slots as the target forward it follows: at the slot of target token ``t_j``
the draft reads ``t_{j+1}`` (with the target's hidden state at ``t_j``), so each
request's input ids are shifted left by one and the token just sampled by the rejection
sampler goes to the request's last *valid* slot. Slots after it held draft tokens the
target rejected; they stay in the batch (so shapes, and CUDA graphs, do not depend on how
many tokens were accepted) and also read the sampled token; their outputs are unused.

Everything is computed from device tensors in one kernel: no ``.item()`` or
``.tolist()``, so the host never waits for the verification result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specula.runtime.kernels.dispatch import use_reference

_BLOCK = 128
"""Tokens per step of a request's copy loop."""


@triton.jit
def _prepare_draft_inputs_kernel(
    draft_input_ids_ptr,  # [num_tokens] int64
    draft_positions_ptr,  # [num_tokens] int64
    last_token_indices_ptr,  # [num_reqs] int64
    input_ids_ptr,  # [num_tokens] int64
    positions_ptr,  # [num_tokens] int64
    query_start_loc_ptr,  # [num_reqs + 1] int32
    cu_num_draft_tokens_ptr,  # [num_reqs] int32
    num_accepted_ptr,  # [num_reqs] int64
    next_token_ids_ptr,  # [num_reqs] int64
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.load(query_start_loc_ptr + req)
    end = tl.load(query_start_loc_ptr + req + 1)
    draft_start = tl.load(cu_num_draft_tokens_ptr + req - 1, mask=req > 0, other=0)
    num_draft = tl.load(cu_num_draft_tokens_ptr + req) - draft_start
    num_rejected = num_draft - tl.load(num_accepted_ptr + req).to(tl.int32)
    last = end - 1 - num_rejected
    next_token = tl.load(next_token_ids_ptr + req)
    for block_start in range(start, end, BLOCK):
        offs = block_start + tl.arange(0, BLOCK)
        in_req = offs < end
        shifted = tl.load(input_ids_ptr + offs + 1, mask=offs < last, other=0)
        ids = tl.where(offs < last, shifted, next_token)
        tl.store(draft_input_ids_ptr + offs, ids, mask=in_req)
        pos = tl.load(positions_ptr + offs, mask=in_req)
        tl.store(draft_positions_ptr + offs, pos, mask=in_req)
    tl.store(last_token_indices_ptr + req, last.to(tl.int64))


def prepare_draft_inputs(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    next_token_ids: torch.Tensor,
    *,
    out_input_ids: torch.Tensor | None = None,
    out_positions: torch.Tensor | None = None,
    out_last_token_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shift each request's target input ids left by one and append the sampled token.

    Args:
        input_ids: [num_tokens] int64, the target forward's input ids, request-major:
            per verifying request, its last emitted token then its draft tokens.
        positions: [num_tokens] int64, their positions.
        query_start_loc: [num_reqs + 1] int32, each request's first token index, then
            ``num_tokens``.
        cu_num_draft_tokens: [num_reqs] int32, inclusive cumulative draft counts (as for
            :func:`specula.runtime.kernels.rejection_sampler.rejection_sample`); a request
            that only prefilled drafted 0.
        num_accepted: [num_reqs] int64, accepted draft tokens per request.
        next_token_ids: [num_reqs] int64, the token the rejection sampler emitted last
            (recovered or bonus) per request.
        out_input_ids, out_positions, out_last_token_indices: optional output buffers
            (static CUDA-graph buffers) of the shapes below.

    Returns:
        ``(draft_input_ids [num_tokens] int64, draft_positions [num_tokens] int64,
        last_token_indices [num_reqs] int64)``: request ``i``'s slot ``j`` holds its target
        input at ``j + 1`` up to its last valid slot ``last_token_indices[i] =
        query_start_loc[i + 1] - 1 - (num_draft_i - num_accepted[i])``, which holds
        ``next_token_ids[i]`` (as do the rejected slots after it); positions are the
        target's.

    Raises:
        AssertionError: shapes, dtypes or layouts do not match the above.
    """
    assert input_ids.ndim == 1 and input_ids.dtype == torch.int64 and input_ids.is_contiguous()
    assert positions.shape == input_ids.shape and positions.dtype == torch.int64
    num_tokens, num_reqs = input_ids.shape[0], cu_num_draft_tokens.shape[0]
    assert query_start_loc.shape == (num_reqs + 1,) and query_start_loc.dtype == torch.int32
    assert cu_num_draft_tokens.ndim == 1 and cu_num_draft_tokens.dtype == torch.int32
    assert num_accepted.shape == (num_reqs,) and num_accepted.dtype == torch.int64
    assert next_token_ids.shape == (num_reqs,) and next_token_ids.dtype == torch.int64
    for t in (positions, query_start_loc, cu_num_draft_tokens, num_accepted, next_token_ids):
        assert t.is_contiguous()
    ids = torch.empty_like(input_ids) if out_input_ids is None else out_input_ids
    pos = torch.empty_like(positions) if out_positions is None else out_positions
    last = out_last_token_indices
    last = input_ids.new_empty(num_reqs) if last is None else last
    assert ids.shape[0] >= num_tokens and pos.shape[0] >= num_tokens
    assert ids.dtype == pos.dtype == last.dtype == torch.int64 and last.shape[0] >= num_reqs
    if num_reqs > 0 and use_reference(input_ids):
        ids[:num_tokens], pos[:num_tokens], last[:num_reqs] = prepare_draft_inputs_reference(
            input_ids, positions, query_start_loc, cu_num_draft_tokens, num_accepted,
            next_token_ids,
        )
    elif num_reqs > 0:
        _prepare_draft_inputs_kernel[(num_reqs,)](
            ids, pos, last, input_ids, positions, query_start_loc, cu_num_draft_tokens,
            num_accepted, next_token_ids, BLOCK=_BLOCK, enable_fp_fusion=True,
        )
    return ids, pos, last


def prepare_draft_inputs_reference(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    next_token_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`prepare_draft_inputs` (same arguments and results), one
    request at a time on the host."""
    draft_input_ids = torch.empty_like(input_ids)
    last_token_indices = torch.empty_like(num_accepted)
    starts = query_start_loc.tolist()
    ends = cu_num_draft_tokens.tolist()
    for req in range(len(ends)):
        num_draft = ends[req] - (ends[req - 1] if req > 0 else 0)
        last = starts[req + 1] - 1 - (num_draft - int(num_accepted[req]))
        draft_input_ids[starts[req] : last] = input_ids[starts[req] + 1 : last + 1]
        draft_input_ids[last : starts[req + 1]] = next_token_ids[req]
        last_token_indices[req] = last
    return draft_input_ids, positions.clone(), last_token_indices
