"""Attention over a flattened batch with a per-request slot KV cache.

Tokens of all requests in a forward are flattened to ``[num_tokens, ...]`` so that the
linear layers run without padding. Attention itself gathers each request's cached keys
and values and runs ``scaled_dot_product_attention`` on a padded ``[batch, max_query_len]``
view; requests are put in groups so that one long prefill does not pad every short decode
query to its length.

The metadata is built once per forward and passed explicitly to every layer (no global
forward context).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

_SHARED_GROUP_MAX_QUERY_LEN = 16
"""Requests with at most this many query tokens share one padded attention call; longer
ones (prefills) get their own, so padding never multiplies a prefill's cost by the
batch size."""


@dataclass
class AttentionGroup:
    """Requests whose attention runs in one padded SDPA call."""

    slot_ids: torch.Tensor
    """[group_size] KV-cache slot of each request."""
    token_indices: torch.Tensor
    """[group_tokens] indices into the flattened token dimension."""
    pad_rows: torch.Tensor
    """[group_tokens] request index (within the group) of each token."""
    pad_cols: torch.Tensor
    """[group_tokens] query index (within its request) of each token."""
    mask: torch.Tensor
    """[group_size, 1, max_query_len, max_seq_len] bool; True where a query may attend."""
    max_query_len: int
    max_seq_len: int
    first_slot: int | None = None
    """Set when ``slot_ids`` are consecutive (the common case): the cache rows are then
    read through a view instead of a gather copy."""
    query_positions: torch.Tensor | None = None
    """[group_size, max_query_len] cache position of each query (0 in padding cells), on
    the host (only :func:`with_sliding_window` reads it, so full-attention models never
    copy it to the device)."""


@dataclass
class AttentionMetadata:
    """Where each token's key/value goes in the cache and which keys each query sees."""

    token_slot_ids: torch.Tensor
    """[num_tokens] KV-cache slot of each token's request."""
    cache_positions: torch.Tensor
    """[num_tokens] position of each token in its request's KV cache."""
    groups: list[AttentionGroup]
    num_tokens: int


def build_attention_metadata(
    slot_ids: list[int],
    query_lens: list[int],
    start_positions: list[int],
    device: torch.device,
) -> AttentionMetadata:
    """Describe a forward in which request ``i`` appends ``query_lens[i]`` tokens to its
    cache slot ``slot_ids[i]`` at positions ``start_positions[i]`` onwards, attending
    causally to everything before them in the slot.

    Tokens are expected flattened request by request, in the order of ``slot_ids``.
    """
    num_reqs = len(slot_ids)
    assert len(query_lens) == num_reqs and len(start_positions) == num_reqs
    assert all(q > 0 for q in query_lens), "every request needs at least one query token"
    req_starts = [0] * num_reqs
    total = 0
    for i, q in enumerate(query_lens):
        req_starts[i] = total
        total += q

    q_lens = torch.tensor(query_lens, dtype=torch.long)
    starts = torch.tensor(start_positions, dtype=torch.long)
    req_of_token = torch.repeat_interleave(torch.arange(num_reqs), q_lens)  # [num_tokens]
    offset_in_req = torch.arange(total) - torch.tensor(req_starts)[req_of_token]
    cache_positions = starts[req_of_token] + offset_in_req
    slots = torch.tensor(slot_ids, dtype=torch.long)

    shared = [i for i, q in enumerate(query_lens) if q <= _SHARED_GROUP_MAX_QUERY_LEN]
    members = [shared] if shared else []
    members += [[i] for i, q in enumerate(query_lens) if q > _SHARED_GROUP_MAX_QUERY_LEN]
    groups = []
    for reqs in members:
        token_idx = torch.cat(
            [torch.arange(req_starts[i], req_starts[i] + query_lens[i]) for i in reqs]
        )
        rows_of_req = torch.full((num_reqs,), -1, dtype=torch.long)
        rows_of_req[reqs] = torch.arange(len(reqs))
        pad_rows = rows_of_req[req_of_token[token_idx]]
        pad_cols = offset_in_req[token_idx]
        max_q = max(query_lens[i] for i in reqs)
        max_kv = max(start_positions[i] + query_lens[i] for i in reqs)
        # Padded query cells keep position 0 so that their softmax row is never empty;
        # their outputs are dropped when scattering back.
        query_pos = torch.zeros((len(reqs), max_q), dtype=torch.long)
        query_pos[pad_rows, pad_cols] = cache_positions[token_idx]
        mask = torch.arange(max_kv)[None, None, :] <= query_pos[:, :, None]
        group_slots = [slot_ids[i] for i in reqs]
        consecutive = group_slots == list(range(group_slots[0], group_slots[0] + len(reqs)))
        groups.append(
            AttentionGroup(
                slot_ids=slots[reqs].to(device),
                token_indices=token_idx.to(device),
                pad_rows=pad_rows.to(device),
                pad_cols=pad_cols.to(device),
                mask=mask[:, None].to(device),
                max_query_len=max_q,
                max_seq_len=max_kv,
                first_slot=group_slots[0] if consecutive else None,
                query_positions=query_pos,
            )
        )
    return AttentionMetadata(
        token_slot_ids=slots[req_of_token].to(device),
        cache_positions=cache_positions.to(device),
        groups=groups,
        num_tokens=total,
    )


def with_sliding_window(metadata: AttentionMetadata, window: int) -> AttentionMetadata:
    """The same forward with each query restricted to the last ``window`` cache
    positions up to its own (``query_pos - window < kv_pos <= query_pos``), as
    sliding-window layers (Mistral, Gemma) attend. Built once per forward by models
    that have such layers; the full-attention metadata is left untouched.

    Raises:
        ValueError: ``window`` < 1, or ``metadata`` lacks query positions.
    """
    if window < 1:
        raise ValueError(f"sliding window {window} must be >= 1")
    groups = []
    for g in metadata.groups:
        if g.query_positions is None:
            raise ValueError("attention metadata has no query_positions to window")
        kv_pos = torch.arange(g.max_seq_len)
        # [group_size, 1, max_query_len, max_seq_len]
        inside = kv_pos[None, None, None, :] > (g.query_positions - window)[:, None, :, None]
        groups.append(replace(g, mask=g.mask & inside.to(g.mask.device)))
    return replace(metadata, groups=groups)


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write ``k, v`` into the cache and attend.

    Args:
        q: [num_tokens, num_heads, head_dim]
        k, v: [num_tokens, num_kv_heads, head_dim]
        k_cache, v_cache: [num_slots, num_kv_heads, capacity, head_dim] of one layer.
        metadata: from :func:`build_attention_metadata`.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        [num_tokens, num_heads, head_dim]
    """
    assert q.ndim == 3 and k.ndim == 3 and k_cache.ndim == 4
    # Advanced indices on dims 0 and 2 put the token dim first: [num_tokens, kv_heads, head_dim].
    k_cache[metadata.token_slot_ids, :, metadata.cache_positions] = k
    v_cache[metadata.token_slot_ids, :, metadata.cache_positions] = v
    return attend_cached(q, k_cache, v_cache, metadata, scale)


def attend_cached(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attend to keys and values already in the cache, writing nothing: the read half
    of :func:`cached_attention`, for layers that reuse another layer's KV (Gemma4
    ``num_kv_shared_layers``, Gemma4 MTP drafts).

    Args:
        q: [num_tokens, num_heads, head_dim]
        k_cache, v_cache: [num_slots, num_kv_heads, capacity, head_dim] of one layer.

    Returns:
        [num_tokens, num_heads, head_dim]
    """
    assert q.ndim == 3 and k_cache.ndim == 4
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group_size = num_heads // num_kv_heads
    out = q.new_empty(num_tokens, num_heads, head_dim)
    for g in metadata.groups:
        bsz = g.slot_ids.shape[0]
        if g.first_slot is not None:
            rows = slice(g.first_slot, g.first_slot + bsz)
            keys = k_cache[rows, :, : g.max_seq_len]  # [bsz, kv_heads, max_seq_len, head_dim]
            values = v_cache[rows, :, : g.max_seq_len]
        else:
            keys = k_cache[g.slot_ids, :, : g.max_seq_len]
            values = v_cache[g.slot_ids, :, : g.max_seq_len]
        if group_size > 1:
            keys = keys.repeat_interleave(group_size, dim=1)  # [bsz, heads, max_seq_len, head_dim]
            values = values.repeat_interleave(group_size, dim=1)
        queries = q.new_zeros(bsz, g.max_query_len, num_heads, head_dim)
        queries[g.pad_rows, g.pad_cols] = q[g.token_indices]
        attn = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys, values, attn_mask=g.mask, scale=scale
        )  # [bsz, heads, max_query_len, head_dim]
        out[g.token_indices] = attn.transpose(1, 2)[g.pad_rows, g.pad_cols]
    return out
