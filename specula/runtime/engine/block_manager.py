"""Paged KV block allocation (PagedAttention, Kwon et al., arXiv 2309.06180).

The KV cache is a pool of fixed-size blocks of ``block_size`` token slots. Each request
owns an ordered list of blocks, its *block table*: its token ``t`` lives in block
``block_table[t // block_size]`` at offset ``t % block_size``, i.e. in slot
``block * block_size + offset`` (vLLM's slot convention, what
:func:`specula.runtime.kernels.reshape_and_cache.reshape_and_cache` takes).

Admission keeps a *watermark* of free blocks (vLLM's ``watermark``): a new request is
admitted only if the blocks left after its allocation stay above it, so that running
requests can still grow by a few blocks before anything must be preempted. Growing a
running request (:meth:`BlockManager.resize`, one decode token or the ``k + 1``
tokens of a verification step) may use the reserve.

Pure Python: no torch, no device; the model runner turns block tables and slots into
device tensors.
"""

from __future__ import annotations

from collections.abc import Hashable


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than an allocation needs; the scheduler should
    have checked :meth:`BlockManager.can_allocate` and preempted first."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Free list of KV blocks and the block table of every running request.

    Args:
        num_blocks: blocks in the pool (> 0).
        block_size: token slots per block (> 0).
        watermark: fraction of ``num_blocks`` kept free at admission, in ``[0, 1)``;
            vLLM's default is 0.01.

    Raises:
        ValueError: a non-positive size or a watermark outside ``[0, 1)``.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be > 0")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark={watermark} must be in [0, 1)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        # Popped from the end: the most recently freed block is reused first, so a
        # small working set keeps touching the same memory.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}
        self._num_tokens: dict[Hashable, int] = {}

    # -- queries ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def block_table(self, request_id: Hashable) -> list[int]:
        """The request's block ids, in token order (a copy).

        Raises:
            KeyError: unknown request.
        """
        return list(self._tables[request_id])

    def num_tokens(self, request_id: Hashable) -> int:
        """Token slots the request holds (its context length once the current step's
        tokens are written).

        Raises:
            KeyError: unknown request.
        """
        return self._num_tokens[request_id]

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new request of ``num_tokens`` tokens fits above the watermark."""
        needed = self.num_blocks_needed(num_tokens)
        return self.num_free_blocks - needed >= self.watermark_blocks

    # -- updates ---------------------------------------------------------------------

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        taken.reverse()
        return taken

    def allocate(self, request_id: Hashable, num_tokens: int) -> list[int]:
        """Give a new request the blocks for its first ``num_tokens`` tokens (the prompt).

        Returns:
            the request's block table (a copy).

        Raises:
            ValueError: ``request_id`` already holds blocks, or ``num_tokens`` < 0.
            NoFreeBlocksError: not enough free blocks (the watermark is not enforced here;
                call :meth:`can_allocate` to admit).
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds KV blocks")
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} must be >= 0")
        self._tables[request_id] = self._take(self.num_blocks_needed(num_tokens))
        self._num_tokens[request_id] = num_tokens
        return list(self._tables[request_id])

    def append_slots(self, request_id: Hashable, num_new_tokens: int) -> list[int]:
        """Grow the request by ``num_new_tokens`` token slots, taking new blocks as needed.

        Returns:
            the slot ids of the new tokens, ``[num_new_tokens]``.

        Raises:
            KeyError: unknown request. ValueError: ``num_new_tokens`` < 0.
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
            the index in the block table of the first block taken (``len(table)`` when
            none was).

        Raises:
            KeyError: unknown request. ValueError: ``num_tokens`` < 0.
            NoFreeBlocksError: not enough free blocks; nothing is changed then.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} must be >= 0")
        table = self._tables[request_id]
        have, need = len(table), self.num_blocks_needed(num_tokens)
        if need > have:
            table.extend(self._take(need - have))
        elif need < have:
            self._free.extend(reversed(table[need:]))
            del table[need:]
        self._num_tokens[request_id] = num_tokens
        return have if need > have else len(table)

    def num_blocks_held(self, request_id: Hashable) -> int:
        """Blocks in the request's table.

        Raises:
            KeyError: unknown request.
        """
        return len(self._tables[request_id])

    def blocks_from(self, request_id: Hashable, start: int) -> list[int]:
        """The request's block ids from table index ``start`` on (a copy).

        Raises:
            KeyError: unknown request.
        """
        return self._tables[request_id][start:]

    def free(self, request_id: Hashable) -> None:
        """Return all of the request's blocks (finished or preempted).

        Raises:
            KeyError: unknown request.
        """
        table = self._tables.pop(request_id)
        del self._num_tokens[request_id]
        self._free.extend(reversed(table))
