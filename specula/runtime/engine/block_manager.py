"""Paged KV block allocation (PagedAttention, Kwon et al., arXiv 2309.06180).

The KV cache is a pool of fixed-size blocks of ``block_size`` token slots. Each request
owns an ordered list of blocks, its *block table*: its token ``t`` lives in block
``block_table[t // block_size]`` at offset ``t % block_size``, i.e. in slot
``block * block_size + offset`` (vLLM's slot convention, what
:func:`specula.runtime.kernels.reshape_and_cache.reshape_and_cache` takes).

Admission keeps a *watermark* of free blocks (vLLM's ``watermark``): a new request is
admitted only if the blocks left after its allocation stay above it, a reserve that
running requests may grow into (:meth:`BlockManager.resize`) before any is preempted.

Automatic prefix caching (vLLM's, after SGLang's RadixAttention, Zheng et al., arXiv 2312.07104): a
full block of committed tokens is named by a hash chain, the SHA-256 of its parent block's hash and
its own token ids, so equal names mean equal prefixes. A new request reuses the blocks of its
longest cached prefix (reference-counted, never written: only full blocks of committed tokens are
cached, and a request always computes at least its last prompt token). A freed block keeps its name
until it is reused; free blocks with no name are taken first, then named ones least recently freed
first (LRU eviction), the tail of a request before its head.

Pure Python, no torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than an allocation needs (the scheduler checks
    :meth:`BlockManager.can_allocate` and preempts first)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Free list of KV blocks and the block table of every running request.

    Args:
        num_blocks: blocks in the pool (> 0).
        block_size: token slots per block (> 0).
        watermark: fraction of ``num_blocks`` kept free at admission, in ``[0, 1)``.
        enable_prefix_caching: name and reuse full blocks (module docstring).

    Raises:
        ValueError: a non-positive size or a watermark outside ``[0, 1)``. Methods that
            take a ``request_id`` raise KeyError for an unknown request.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 enable_prefix_caching: bool = False) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be > 0")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark={watermark} must be in [0, 1)")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.watermark_blocks = int(watermark * num_blocks)
        # Popped from the end: the most recently freed block is reused first, so a
        # small working set keeps touching the same memory.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}
        self._num_tokens: dict[Hashable, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self._refs = [0] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Free blocks that keep a name, least recently freed first."""
        self._name_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._names: dict[Hashable, list[bytes]] = {}
        """Per request, the names of its leading full blocks computed so far."""
        self.prefix_cache_queries = 0
        """Prompt tokens looked up in the prefix cache (a counter, vLLM's semantics)."""
        self.prefix_cache_hits = 0
        """Of those, tokens found cached (a counter)."""

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a named prefix, in use or free."""
        return len(self._block_of)

    def block_table(self, request_id: Hashable) -> list[int]:
        """The request's block ids, in token order (a copy)."""
        return list(self._tables[request_id])

    def num_tokens(self, request_id: Hashable) -> int:
        """Token slots the request holds (its context length once the step's tokens are in)."""
        return self._num_tokens[request_id]

    def can_allocate(self, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Whether a new request of ``num_tokens`` tokens, reusing the ``cached`` blocks
        of :meth:`match_prefix`, fits above the watermark."""
        needed = cdiv(num_tokens, self.block_size) - len(cached)
        needed += sum(self._refs[b] == 0 for b in cached)  # free now, in use then
        return self.num_free_blocks - needed >= self.watermark_blocks

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks of ``token_ids``' longest cached prefix of full blocks,
        short of the last token (which a request computes to sample from); ``[]`` with
        caching off. Changes nothing."""
        blocks: list[int] = []
        parent = b""
        for i in range((len(token_ids) - 1) // self.block_size):  # none named with caching off
            parent = self._name(parent, token_ids, i)
            block = self._block_of.get(parent)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _name(self, parent: bytes, token_ids: Sequence[int], i: int) -> bytes:
        bs = self.block_size
        return hashlib.sha256(parent + array("q", token_ids[i * bs : (i + 1) * bs]).tobytes()).digest()

    def _take(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {n} blocks, {self.num_free_blocks} free")
        taken = [self._free.pop() for _ in range(min(n, len(self._free)))]
        for _ in range(n - len(taken)):  # evict the least recently freed named blocks
            block = self._evictable.popitem(last=False)[0]
            del self._block_of[self._name_of.pop(block)]
            taken.append(block)
        for block in taken:
            self._refs[block] = 1
        return taken

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks`` (given tail first)."""
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._name_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def allocate(self, request_id: Hashable, num_tokens: int, cached: Sequence[int] = ()) -> list[int]:
        """Give a new request the blocks for its first ``num_tokens`` tokens (the prompt),
        the ``cached`` blocks of :meth:`match_prefix` first (shared, not copied).

        Returns:
            the request's block table (a copy).

        Raises:
            ValueError: ``request_id`` already holds blocks, ``num_tokens`` < 0, or
                ``cached`` names blocks that are not cached.
            NoFreeBlocksError: not enough free blocks (the watermark is not enforced here;
                call :meth:`can_allocate` to admit).
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds KV blocks")
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} must be >= 0")
        if any(b not in self._name_of for b in cached):
            raise ValueError(f"blocks {list(cached)} are not all cached")
        for block in cached:
            self._evictable.pop(block, None)
            self._refs[block] += 1
        fresh = self._take(max(0, cdiv(num_tokens, self.block_size) - len(cached)))
        self._tables[request_id] = list(cached) + fresh
        self._num_tokens[request_id] = num_tokens
        self._names[request_id] = [self._name_of[b] for b in cached]
        return list(self._tables[request_id])

    def record_prompt(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """Count a prefix-cache lookup of a prompt (the ``prefix_cache_*`` counters)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_prompt_tokens
            self.prefix_cache_hits += num_cached_tokens

    def cache_blocks(self, request_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Name the request's full blocks among its first ``num_computed`` tokens (their
        KV written), so later requests can reuse them. A block whose name another block
        already holds stays unnamed. No-op with caching off."""
        if not self.enable_prefix_caching:
            return
        names, table = self._names[request_id], self._tables[request_id]
        full = min(num_computed, len(token_ids)) // self.block_size
        for i in range(len(names), min(full, len(table))):
            name = self._name(names[-1] if names else b"", token_ids, i)
            names.append(name)
            if name not in self._block_of and table[i] not in self._name_of:
                self._block_of[name] = table[i]
                self._name_of[table[i]] = name

    def append_slots(self, request_id: Hashable, num_new_tokens: int) -> list[int]:
        """Grow the request by ``num_new_tokens`` token slots, taking new blocks as needed.

        Returns:
            the slot ids of the new tokens, ``[num_new_tokens]``.

        Raises:
            ValueError: ``num_new_tokens`` < 0.
            NoFreeBlocksError: not enough free blocks; nothing is changed then.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens} must be >= 0")
        start = self._num_tokens[request_id]
        self.resize(request_id, start + num_new_tokens)
        table, bs = self._tables[request_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + num_new_tokens)]

    def resize(self, request_id: Hashable, num_tokens: int) -> int:
        """Hold exactly the blocks for ``num_tokens`` tokens: take new blocks or return
        those past them (after verification, the slots of rejected draft tokens).

        Returns:
            the block-table index of the first block taken (``len(table)`` when none was).

        Raises:
            ValueError: ``num_tokens`` < 0.
            NoFreeBlocksError: not enough free blocks; nothing is changed then.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} must be >= 0")
        table = self._tables[request_id]
        have, need = len(table), cdiv(num_tokens, self.block_size)
        if need > have:
            table.extend(self._take(need - have))
        elif need < have:
            self._release(table[need:][::-1])
            del table[need:]
            del self._names[request_id][need:]
        self._num_tokens[request_id] = num_tokens
        return have if need > have else len(table)

    def num_blocks_held(self, request_id: Hashable) -> int:
        return len(self._tables[request_id])

    def blocks_from(self, request_id: Hashable, start: int) -> list[int]:
        """The request's block ids from table index ``start`` on (a copy)."""
        return self._tables[request_id][start:]

    def free(self, request_id: Hashable) -> None:
        """Return all of the request's blocks (finished or preempted)."""
        table = self._tables.pop(request_id)
        del self._num_tokens[request_id], self._names[request_id]
        self._release(table[::-1])
