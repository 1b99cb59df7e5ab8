"""Paged KV-cache tensors and the attention metadata of one forward.

The cache of each layer is a pair ``key_cache, value_cache [num_blocks, block_size,
num_kv_heads, head_dim]`` in vLLM's layout, the one the kernels in
:mod:`specula.runtime.kernels` read and write. The metadata is a plain dataclass of
device tensors passed explicitly to every layer (no global forward context).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from specula.runtime.engine.block_manager import BlockManager, cdiv
from specula.runtime.engine.input_batch import to_device as _to_device
from specula.runtime.models.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the paged KV cache of one model: one key/value pair per layer that owns
    storage, each ``[num_blocks, block_size, num_kv_heads_i, head_dim_i]``. Layers may
    differ (Gemma4's sliding and full layers have their own heads and head size, and its
    KV-shared layers own none); all share ``num_blocks`` and ``block_size``, so one block
    table and slot mapping describe a forward for every layer (vLLM's hybrid KV-cache
    groups, reduced to one group with per-layer tensor shapes)."""

    layer_shapes: tuple[tuple[int, int], ...]
    """``(num_kv_heads, head_dim)`` of each storage-owning layer, in layer order."""
    block_size: int
    """Token slots per block; 16 as vLLM's default."""
    dtype: torch.dtype

    @classmethod
    def from_model_config(cls, config: ModelConfig, dtype: torch.dtype,
                          block_size: int = 16) -> KVCacheSpec:
        """The cache a target needs: ``config.kv_cache_shapes()`` (one shape for every
        layer, or Gemma4's per-layer shapes)."""
        return cls(tuple(config.kv_cache_shapes()), block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers, keys and values."""
        per_token = sum(heads * head_dim for heads, head_dim in self.layer_shapes)
        return 2 * self.block_size * per_token * self.dtype.itemsize


def num_blocks_from_free_memory(bytes_per_block: int, device: torch.device,
                                memory_fraction: float = 0.9, reserve_bytes: int = 1 << 30) -> int:
    """Blocks of ``bytes_per_block`` (summed over every cache indexed by one block id:
    a target's and its draft's) that fit in ``memory_fraction`` of the device's free
    memory minus ``reserve_bytes`` (left for activations and CUDA-graph pools).

    Raises:
        ValueError: not a CUDA device, or no block fits.
    """
    if device.type != "cuda":
        raise ValueError(f"sizing from free memory needs a CUDA device, got {device}")
    free, _ = torch.cuda.mem_get_info(device)
    budget = int(free * memory_fraction) - reserve_bytes
    num_blocks = budget // bytes_per_block
    if num_blocks <= 0:
        raise ValueError(f"no KV block of {bytes_per_block} bytes fits in {budget} bytes")
    return num_blocks


class PagedKVCache:
    """The key and value caches of :class:`KVCacheSpec` ``spec``, ``num_blocks`` blocks per
    layer on ``device``, zero-filled.

    Raises:
        ValueError: ``num_blocks`` <= 0.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be > 0")
        self.spec = spec
        self.num_blocks = num_blocks
        shapes = [(num_blocks, spec.block_size, h, d) for h, d in spec.layer_shapes]
        # Zero-filled, not empty: a padded verification row may read a stale slot whose
        # softmax weight is 0, and 0 * NaN from uninitialised memory would still be NaN.
        self.key_caches = [torch.zeros(s, dtype=spec.dtype, device=device) for s in shapes]
        self.value_caches = [torch.zeros(s, dtype=spec.dtype, device=device) for s in shapes]

    def block_manager(self, watermark: float = 0.01) -> BlockManager:
        """A :class:`BlockManager` over this cache's blocks."""
        return BlockManager(self.num_blocks, self.spec.block_size, watermark)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_caches[i], self.value_caches[i]


@dataclass
class PagedAttentionMetadata:
    """Where a forward's keys and values go and which cached keys each query sees.

    Requests are flattened request-major: request ``i``'s query tokens are rows
    ``query_start_loc[i]:query_start_loc[i + 1]``, the last tokens of its
    ``seq_lens[i]``-token context. A padding request (CUDA-graph batch padded to a
    captured size) has ``seq_lens`` 0 and ``slot_mapping`` -1 for its tokens."""

    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot ``block * block_size + offset`` of each token."""
    block_table: torch.Tensor
    """[num_reqs, max_blocks_per_req] int32 block ids (unused entries 0)."""
    seq_lens: torch.Tensor
    """[num_reqs] int32 context length including this forward's tokens."""
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32 cumulative query lengths."""
    num_reqs: int
    num_tokens: int
    uniform_query_len: int | None
    """Query tokens per request when all requests have the same number (1 for decode,
    ``k + 1`` for verification), else ``None``."""
    prefill: bool
    """Every request's context starts empty (``seq_lens == query_lens``): attention
    runs on the prompt itself instead of reading the paged cache."""
    query_lens_cpu: tuple[int, ...] = ()
    """Host copy of the query lengths; the prefill path slices requests with it."""
    context_lens_cpu: tuple[int, ...] = ()
    """Prefill requests only: each one's cached context before its query tokens (a
    reused prefix; the prefill path then reads it from the cache); empty: none has one."""
    context_groups: tuple[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor], ...] = ()
    """Prefill requests with a context, batched by query length: ``(query_len, rows [g *
    query_len] int64, block_table [g, max_blocks] int32, seq_lens [g] int32)`` per group,
    for the paged attention kernel."""
    split: tuple[PagedAttentionMetadata, PagedAttentionMetadata] | None = None
    """A *mixed* batch (continuous batching: running requests decode or verify while new
    ones prefill in the same forward): ``(decode part, prefill part)``, the metadata of
    its first ``decode.num_reqs`` requests (one uniform query length, context in the
    paged cache) and of the remaining ones (context empty). ``None`` otherwise. Token
    rows keep the batch order, decode rows first."""

    @classmethod
    def from_query_lens(cls, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        query_lens: Sequence[int], prefill: bool = False) -> PagedAttentionMetadata:
        """The metadata of requests with ``query_lens`` query tokens each (host ints), which
        give ``num_reqs``, ``num_tokens``, ``uniform_query_len`` and ``query_lens_cpu``; the
        tensors are the fields of the same names."""
        lens = tuple(query_lens)
        return cls(
            slot_mapping, block_table, seq_lens, query_start_loc, num_reqs=len(lens),
            num_tokens=sum(lens), uniform_query_len=_uniform(lens), prefill=prefill,
            query_lens_cpu=lens)


def device_metadata(block_table: torch.Tensor, starts: torch.Tensor, query_lens: Sequence[int],
                    block_size: int) -> tuple[PagedAttentionMetadata, torch.Tensor]:
    """The metadata of a batch whose block tables and context lengths are on the device
    (the engine's persistent state): slot mapping, positions and sequence lengths are
    computed there, only the query lengths come from the host.

    Requests are decode or verification requests of one query length (context in the
    cache, ``starts > 0``) followed by prefills (``starts == 0``); the host says how many
    of each through ``query_lens`` and the prefill rows' ``starts``.

    Args:
        block_table: [num_reqs, max_blocks_per_req] int32, covering every position.
        starts: [num_reqs] int64, each request's first query position (its cached context length).
        query_lens: per request, its query tokens (host).
        block_size: tokens per block.

    Returns:
        ``(metadata, positions [num_tokens] int64)``.
    """
    device = block_table.device
    num_reqs = len(query_lens)
    uniform = _uniform(query_lens)
    if uniform is not None:
        # No repeat_interleave: with a host int it still reads its output size back.
        positions = starts[:, None] + torch.arange(uniform, device=device)  # [num_reqs, q]
        blocks = block_table.gather(1, positions // block_size).reshape(-1).long()
        positions = positions.reshape(-1)
        query_start_loc = torch.arange(
            0, (num_reqs + 1) * uniform, uniform, device=device, dtype=torch.int32)
    else:
        token_req = _to_device([i for i, q in enumerate(query_lens) for _ in range(q)], torch.int64, device)
        offsets = _to_device([j for q in query_lens for j in range(q)], torch.int64, device)
        positions = starts[token_req] + offsets
        query_start_loc = _to_device(list(accumulate(query_lens, initial=0)), torch.int32, device)
        blocks = block_table[token_req, positions // block_size].long()
    lens = _to_device(list(query_lens), torch.int64, device) if uniform is None else uniform
    metadata = PagedAttentionMetadata.from_query_lens(
        blocks * block_size + positions % block_size, block_table,
        (starts + lens).to(torch.int32), query_start_loc, query_lens)
    return metadata, positions


def mark_prefills(metadata: PagedAttentionMetadata, num_decode: int,
                  context_lens: Sequence[int] = ()) -> PagedAttentionMetadata:
    """Say which requests of ``metadata`` prefill: all after the first ``num_decode``
    (a pure prefill batch, or a mixed one split for attention), with ``context_lens``
    cached tokens before their queries (default none)."""
    context = tuple(context_lens) if any(context_lens) else ()
    prefill = metadata
    if num_decode == 0:
        metadata.prefill = True
    elif num_decode < metadata.num_reqs and (split := _split_mixed(metadata, num_decode)):
        metadata.split, prefill = split, split[1]
    if context and prefill.prefill:
        prefill.context_lens_cpu = context
        prefill.context_groups = _context_groups(prefill)
    return metadata


def _context_groups(metadata: PagedAttentionMetadata) -> tuple:
    """:attr:`PagedAttentionMetadata.context_groups` of a prefill ``metadata`` (copied to
    the device once per forward, not per layer)."""
    starts = list(accumulate(metadata.query_lens_cpu, initial=0))
    by_len: dict[int, list[int]] = {}
    for i, (ctx, length) in enumerate(zip(metadata.context_lens_cpu, metadata.query_lens_cpu, strict=True)):
        if ctx:
            by_len.setdefault(length, []).append(i)
    device = metadata.block_table.device
    return tuple((
        length,
        _to_device([r for i in reqs for r in range(starts[i], starts[i + 1])], torch.int64, device),
        metadata.block_table[_to_device(reqs, torch.int64, device)],
        _to_device([metadata.context_lens_cpu[i] + length for i in reqs], torch.int32, device),
    ) for length, reqs in by_len.items())


def build_attention_metadata(block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int],
                             query_lens: Sequence[int], block_size: int, max_blocks_per_req: int,
                             device: torch.device) -> tuple[PagedAttentionMetadata, torch.Tensor]:
    """Device metadata and rotary positions for a batch described on the host.

    Args:
        block_tables: per request, its block ids (from :class:`BlockManager`), covering
            at least ``seq_lens[i]`` tokens.
        seq_lens: per request, context length including this forward's tokens.
        query_lens: per request, tokens in this forward (<= ``seq_lens[i]``).
        block_size: tokens per block.
        max_blocks_per_req: width of the block-table tensor; fixed per engine (from the
            maximum model length) so CUDA graphs and kernel launch shapes stay valid.
        device: target device.

    Returns:
        ``(metadata, positions [num_tokens] int64)``.

    Raises:
        ValueError: inconsistent lengths, or a block table too short or too wide.
    """
    num_reqs = len(seq_lens)
    if not (len(block_tables) == len(query_lens) == num_reqs):
        raise ValueError("block_tables, seq_lens and query_lens differ in length")
    for table, seq_len, q_len in zip(block_tables, seq_lens, query_lens, strict=True):
        if not 0 < q_len <= seq_len:
            raise ValueError(f"query_len {q_len} must be in (0, seq_len={seq_len}]")
        if len(table) < cdiv(seq_len, block_size) or len(table) > max_blocks_per_req:
            raise ValueError(f"block table of {len(table)} blocks for {seq_len} tokens "
                             f"(block_size {block_size}, at most {max_blocks_per_req} blocks)")
    rows = [[*table, *[0] * (max_blocks_per_req - len(table))] for table in block_tables]
    starts = [s - q for s, q in zip(seq_lens, query_lens, strict=True)]
    metadata, positions = device_metadata(
        _to_device(rows, torch.int32, device).view(num_reqs, max_blocks_per_req),
        _to_device(starts, torch.int64, device), query_lens, block_size)
    # Decode requests first, then prefills: any other order is left unsplit (refused), and
    # so is a mixed batch of one query length (attention reads it from the cache).
    num_decode = next((i for i, start in enumerate(starts) if start == 0), num_reqs)
    if not any(starts[num_decode:]) and (num_decode == 0 or metadata.uniform_query_len is None):
        mark_prefills(metadata, num_decode)
    return metadata, positions


def _uniform(lens: Sequence[int]) -> int | None:
    """The one value of ``lens``, ``None`` when empty or when they differ."""
    return lens[0] if lens and all(q == lens[0] for q in lens) else None


def _split_mixed(metadata: PagedAttentionMetadata,
                 num_decode: int) -> tuple[PagedAttentionMetadata, PagedAttentionMetadata] | None:
    """The ``(decode, prefill)`` parts of a batch of ``num_decode`` decode or
    verification requests followed by prefills; ``None`` when the decode requests differ
    in query length (attention then refuses the batch)."""
    decode_lens = metadata.query_lens_cpu[:num_decode]
    if _uniform(decode_lens) is None:
        return None
    n = sum(decode_lens)
    qsl = metadata.query_start_loc
    return (
        PagedAttentionMetadata.from_query_lens(
            metadata.slot_mapping[:n], metadata.block_table[:num_decode],
            metadata.seq_lens[:num_decode], qsl[: num_decode + 1], decode_lens),
        PagedAttentionMetadata.from_query_lens(
            metadata.slot_mapping[n:], metadata.block_table[num_decode:],
            metadata.seq_lens[num_decode:], qsl[num_decode:] - n,
            metadata.query_lens_cpu[num_decode:], prefill=True))
