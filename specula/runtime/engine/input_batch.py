"""Per-request state kept on the device between steps, updated in place (vLLM Model Runner
V2's persistent input batch, ``vllm/v1/worker/gpu/input_batch.py`` and ``block_table.py``).

A running request owns one *row* of every tensor from admission until it finishes or
is preempted. A step names its requests by their rows (``idx_mapping``, batch order ->
row) and gathers what it needs on the device: the last sampled token and the drafts to
verify, the context length, the block table, the sampling settings. The host writes
only what changed since the last step (new block-table entries, a new request's
settings and tokens), batched into a few copies by :meth:`InputBatch.flush`; the device
updates the rest itself after sampling (:meth:`InputBatch.commit`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from specula.runtime.engine.block_manager import BlockManager
from specula.runtime.engine.request import Request
from specula.runtime.engine.sampler import SamplingMetadata, flags_of


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device) -> torch.Tensor:
    """A host list on ``device`` through a pinned staging tensor (asynchronous on CUDA;
    PyTorch's caching host allocator keeps the staging tensor alive until the copy ran)."""
    pin = torch.device(device).type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)


class InputBatch:
    """Device state of up to ``max_num_reqs`` running requests.

    Args:
        max_num_reqs: rows (the engine's ``max_num_seqs``).
        max_blocks_per_req: block-table width.
        max_num_speculative_tokens: draft columns (at least 1).
        vocab_size: columns of :attr:`draft_probs` when ``keep_draft_probs``.
        token_capacity: columns of :attr:`token_ids` (every token of a request, for
            speculators that read the history); ``None`` keeps no history.
        keep_draft_probs: keep the distributions probabilistic drafts were sampled from.
    """

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, max_num_speculative_tokens: int,
                 vocab_size: int, device: torch.device, token_capacity: int | None = None,
                 keep_draft_probs: bool = False) -> None:
        r, k = max_num_reqs, max(max_num_speculative_tokens, 1)
        self.device = device
        i64 = {"dtype": torch.int64, "device": device}
        f32 = {"dtype": torch.float32, "device": device}
        self.block_table = torch.zeros(r, max_blocks_per_req, dtype=torch.int32, device=device)
        """[max_num_reqs, max_blocks_per_req] int32 block ids (target and drafts share)."""
        self.num_computed_tokens = torch.zeros(r, **i64)
        """[max_num_reqs] tokens whose KV is committed: the position of the last token."""
        self.last_token_ids = torch.zeros(r, **i64)
        """[max_num_reqs] the last sampled token (input of the next forward)."""
        self.draft_token_ids = torch.zeros(r, k, **i64)
        """[max_num_reqs, k_max] the drafts the next verification checks."""
        self.num_draft_tokens = torch.zeros(r, **i64)
        """[max_num_reqs] how many leading drafts are real (n-gram drafts may be short)."""
        self.draft_probs = torch.zeros(r, k, vocab_size, **f32) if keep_draft_probs else None
        """[max_num_reqs, k_max, vocab_size] float32 distributions of sampled drafts."""
        self.temperature, self.top_p = torch.zeros(r, **f32), torch.ones(r, **f32)
        self.top_k, self.seeds = torch.zeros(r, **i64), torch.zeros(r, **i64)
        self.token_ids = None if token_capacity is None else torch.zeros(r, token_capacity, **i64)
        """[max_num_reqs, token_capacity] prompt and output tokens, when kept."""
        self.num_tokens = torch.zeros(r, **i64)
        """[max_num_reqs] valid columns of :attr:`token_ids`."""
        self._free_rows = list(range(r - 1, -1, -1))
        self._num_blocks = [0] * r
        self._requests: list[Request | None] = [None] * r
        self._bt_updates: tuple[list[int], list[int], list[int]] = ([], [], [])
        self._new_rows: list[Request] = []
        self.version = 0
        """Bumped whenever a row is given to a request (cached views of rows go stale)."""

    # -- host-side changes, applied by flush() ------------------------------------------

    def add(self, request: Request) -> None:
        """Give ``request`` a free row (its settings are written at the next flush).

        Raises:
            IndexError: no free row (the scheduler admits at most ``max_num_reqs``).
        """
        request.row = row = self._free_rows.pop()
        self._requests[row] = request
        self._num_blocks[row] = 0
        self._new_rows.append(request)
        self.version += 1

    def remove(self, request: Request) -> None:
        if request.row >= 0 and self._requests[request.row] is request:
            self._requests[request.row] = None
            self._free_rows.append(request.row)
        if request in self._new_rows:
            self._new_rows.remove(request)
        request.row = -1

    def sync_blocks(self, request: Request, block_manager: BlockManager) -> None:
        """Record the block-table entries of ``request`` that ``block_manager`` gave it
        since the last call; entries past the blocks it now holds are stale."""
        row, request_id = request.row, request.request_id
        first = self._num_blocks[row]
        new = block_manager.blocks_from(request_id, first)
        rows, cols, values = self._bt_updates
        rows.extend([row] * len(new))
        cols.extend(range(first, first + len(new)))
        values.extend(new)
        self._num_blocks[row] = block_manager.num_blocks_held(request_id)

    def flush(self) -> None:
        """Copy the recorded block-table entries and the new requests' settings and
        tokens to the device (a few batched copies)."""
        dev = self.device
        rows_of = partial(to_device, dtype=torch.int64, device=dev)

        def put(tensor: torch.Tensor, index, values: list) -> None:
            tensor[index] = to_device(values, tensor.dtype, dev)

        rows, cols, values = self._bt_updates
        if rows:
            put(self.block_table, (rows_of(rows), rows_of(cols)), values)
            self._bt_updates = ([], [], [])
        new, self._new_rows = self._new_rows, []
        if not new:
            return
        rows_t = rows_of([q.row for q in new])
        put(self.temperature, rows_t, [q.params.temperature for q in new])
        put(self.top_p, rows_t, [q.params.top_p for q in new])
        put(self.top_k, rows_t, [max(q.params.top_k, 0) for q in new])
        put(self.seeds, rows_t, [q.seed for q in new])
        # index_fill_, not ``[rows_t] = 0``: that copies the host scalar synchronously.
        self.num_draft_tokens.index_fill_(0, rows_t, 0)
        if any(q.num_computed_tokens for q in new):  # after a reused prefix
            put(self.num_computed_tokens, rows_t, [q.num_computed_tokens for q in new])
        else:
            self.num_computed_tokens.index_fill_(0, rows_t, 0)
        if self.token_ids is not None:
            flat_rows = rows_of([q.row for q in new for _ in q.token_ids])
            flat_cols = rows_of([i for q in new for i in range(len(q.token_ids))])
            put(self.token_ids, (flat_rows, flat_cols), [t for q in new for t in q.token_ids])
            put(self.num_tokens, rows_t, [len(q.token_ids) for q in new])

    # -- device-side views and updates --------------------------------------------------

    def sampling(self, idx: torch.Tensor, requests: Sequence[Request]) -> SamplingMetadata:
        """The sampling settings of the requests at rows ``idx [num_reqs]``."""
        return SamplingMetadata(
            self.temperature[idx], self.top_p[idx], self.top_k[idx], self.seeds[idx],
            **flags_of([r.params for r in requests]))

    def commit(self, idx: torch.Tensor, num_computed_tokens: torch.Tensor,
               next_token_ids: torch.Tensor, output_token_ids: torch.Tensor,
               num_accepted: torch.Tensor) -> None:
        """After sampling (all int64): rows ``idx [num_reqs]`` now have
        ``num_computed_tokens [num_reqs]`` committed tokens and ``next_token_ids [num_reqs]``
        as their last token; with a token history, append each row's first
        ``num_accepted[i] + 1`` (in ``[1, n]``) of ``output_token_ids [num_reqs, n]`` to it."""
        self.num_computed_tokens[idx] = num_computed_tokens
        self.last_token_ids[idx] = next_token_ids
        if self.token_ids is None:
            return
        n, last = output_token_ids.shape[1], self.token_ids.shape[1] - 1
        start = self.num_tokens[idx]  # [num_reqs]
        offsets = torch.arange(n, device=idx.device)
        valid = offsets <= num_accepted[:, None]  # [num_reqs, n]
        # Invalid columns write the last column, which nothing reads before it is valid.
        cols = torch.where(valid, start[:, None] + offsets, last).clamp_(max=last)
        rows = idx[:, None].expand(-1, n)
        self.token_ids[rows, cols] = torch.where(valid, output_token_ids, self.token_ids[rows, cols])
        self.num_tokens[idx] = start + num_accepted + 1
