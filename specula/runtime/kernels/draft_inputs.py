"""Inputs of the draft's forwards after a verification step, built on the device.

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

:func:`draft_steps` gives all later draft steps their positions, cache slots and sequence
lengths in one kernel (vLLM's ``EagleProposer`` computes them with a handful of elementwise
operations per step; inside a graph of small draft steps each of those costs a launch).
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
    input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token_ids: torch.Tensor,
    *, out_input_ids: torch.Tensor | None = None, out_positions: torch.Tensor | None = None,
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
        last_token_indices [num_reqs] int64)``: request ``i``'s slot ``j`` holds its target input at
        ``j + 1`` up to its last valid slot ``last_token_indices[i] = query_start_loc[i + 1] - 1 -
        (num_draft_i - num_accepted[i])``, which holds ``next_token_ids[i]`` (as do the rejected
        slots after it); positions are the target's.

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
            next_token_ids)
    elif num_reqs > 0:
        _prepare_draft_inputs_kernel[(num_reqs,)](
            ids, pos, last, input_ids, positions, query_start_loc, cu_num_draft_tokens,
            num_accepted, next_token_ids, BLOCK=_BLOCK, enable_fp_fusion=True)
    return ids, pos, last


def prepare_draft_inputs_reference(
    input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token_ids: torch.Tensor,
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


@triton.jit
def _draft_step_slots_kernel(
    slots_ptr,  # [steps, num_reqs * q] int64
    seq_lens_ptr,  # [steps, num_reqs] int32
    positions_out_ptr,  # [steps, num_reqs * q] int64 (not HAS_VALID)
    positions_ptr,  # [num_reqs, q] int64, contiguous
    valid_ptr,  # [num_reqs] uint8 (a bool tensor's bytes); not HAS_VALID: last position >= 0
    block_table_ptr,  # [>= num_reqs, max_blocks] int32
    stride_bt, q, shift,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_Q: tl.constexpr, WRITES_KV: tl.constexpr, HAS_VALID: tl.constexpr,
):
    req, step = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK_Q)
    in_req = offs < q
    out = step * tl.num_programs(0) * q + req * q + offs
    last = tl.load(positions_ptr + req * q + q - 1)
    if HAS_VALID:
        valid = tl.load(valid_ptr + req) != 0
    else:
        valid = last >= 0
    # A padding row's positions may lie past its table (or below 0).
    pos = tl.where(valid, tl.maximum(tl.load(positions_ptr + req * q + offs, mask=in_req, other=0), 0), 0)
    pos += step * shift
    last = tl.maximum(last, 0) + step * shift
    if not HAS_VALID:
        tl.store(positions_out_ptr + out, pos, mask=in_req)
    if WRITES_KV:
        block = tl.load(block_table_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=in_req, other=0)
        slot = tl.where(valid, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
        seq_len = tl.where(valid, last + 1, 0)
    else:
        slot = tl.full((BLOCK_Q,), -1, tl.int64)
        seq_len = tl.where(valid, last, 0)
    tl.store(slots_ptr + out, slot, mask=in_req)
    tl.store(seq_lens_ptr + step * tl.num_programs(0) + req, seq_len.to(tl.int32))


def draft_step_slots(
    positions: torch.Tensor, valid: torch.Tensor, block_table: torch.Tensor, block_size: int,
    *, writes_kv: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots and sequence lengths of a draft step whose ``q`` query rows per request
    sit at ``positions`` and write their KV there (``writes_kv``), or attend to the KV
    before them and write none (drafts on the target's KV, Gemma4 MTP).

    Args:
        positions: [num_reqs, q] int64, each request's consecutive positions.
        valid: [num_reqs] bool; False marks a padding row (writes nothing, attends to nothing).
        block_table: [>= num_reqs, max_blocks_per_req] int32, row ``i`` request ``i``'s blocks.
        block_size: tokens per KV block.
        writes_kv: False: every slot is -1 and a request's sequence length is ``positions[:, -1]``.

    Returns:
        ``(slot_mapping [num_reqs * q] int64, seq_lens [num_reqs] int32)``: the slot of each
        position (-1 on padding rows) and ``positions[:, -1] + 1`` (0 on padding rows).

    Raises:
        AssertionError: shapes or dtypes do not match the above.
    """
    assert valid.shape == (positions.shape[0],) and valid.dtype == torch.bool
    return _launch(positions, valid, block_table, block_size, 1, 0, writes_kv)[1:]


def draft_steps(
    start: torch.Tensor, block_table: torch.Tensor, block_size: int, steps: int,
    *, shift: int = 1, writes_kv: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`draft_step_slots` of ``steps`` draft steps at once, step ``s`` at the
    positions ``start + s * shift`` (one launch where each step's elementwise position
    update and slot lookup took two inside the draft's graph).

    Args:
        start: [num_reqs, q] int64, step 0's consecutive positions per request; a request
            whose last one is negative is a padding row, and negative positions count as 0.
        block_table, block_size, writes_kv: as :func:`draft_step_slots` takes them.
        steps: the number of steps (>= 1); ``shift``: the positions' advance per step.

    Returns:
        ``(positions [steps, num_reqs * q] int64, slot_mapping [steps, num_reqs * q]
        int64, seq_lens [steps, num_reqs] int32)``, step-major (a step's rows contiguous);
        a padding row's positions are ``s * shift``; sequence lengths as
        :func:`draft_step_slots` gives them (the last position, + 1 where ``writes_kv``).

    Raises:
        AssertionError: ``steps`` < 1, shapes, dtypes or a block table whose rows are not
            contiguous.
    """
    assert steps >= 1
    return _launch(start, None, block_table, block_size, steps, shift, writes_kv)


def _launch(positions, valid, block_table, block_size, steps, shift, writes_kv):
    assert positions.ndim == 2 and positions.dtype == torch.int64
    assert block_table.ndim == 2 and block_table.shape[0] >= positions.shape[0]
    assert block_table.dtype == torch.int32
    if use_reference(positions):
        return draft_steps_reference(positions, valid, block_table, block_size, steps, shift, writes_kv)
    r, q = positions.shape
    positions = positions.contiguous()
    assert block_table.stride(1) == 1
    slots = positions.new_empty(steps, r * q)
    out_positions = positions.new_empty(steps, r * q) if valid is None else slots
    seq_lens = torch.empty(steps, r, dtype=torch.int32, device=positions.device)
    if r > 0:
        flags = positions if valid is None else valid.contiguous().view(torch.uint8)
        _draft_step_slots_kernel[(r, steps)](
            slots, seq_lens, out_positions, positions, flags, block_table, block_table.stride(0), q,
            shift, BLOCK_SIZE=block_size, BLOCK_Q=triton.next_power_of_2(q), WRITES_KV=writes_kv,
            HAS_VALID=valid is not None)
    return (None, slots[0], seq_lens[0]) if valid is not None else (out_positions, slots, seq_lens)


def draft_steps_reference(
    positions: torch.Tensor, valid: torch.Tensor | None, block_table: torch.Tensor,
    block_size: int, steps: int = 1, shift: int = 1, writes_kv: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`draft_steps` (``valid`` None) and of
    :func:`draft_step_slots` (``valid`` given: ``(None, slot_mapping, seq_lens)``)."""
    r, q = positions.shape
    given = valid is not None
    valid = valid if given else positions[:, -1] >= 0
    step_pos = torch.where(valid[:, None], positions.clamp(min=0), 0)[None] + shift * torch.arange(
        steps, device=positions.device)[:, None, None]  # [steps, r, q]
    last = step_pos[:, :, -1]
    if writes_kv:
        rows = torch.arange(r, device=positions.device)[:, None].expand(r, q)
        slots = block_table[rows, step_pos // block_size].long() * block_size + step_pos % block_size
        slots, lens = torch.where(valid[:, None], slots, -1), torch.where(valid, last + 1, 0)
    else:
        slots, lens = torch.full_like(step_pos, -1), torch.where(valid, last, 0)
    slots, lens = slots.reshape(steps, r * q), lens.to(torch.int32)
    return (None, slots[0], lens[0]) if given else (step_pos.reshape(steps, r * q), slots, lens)
