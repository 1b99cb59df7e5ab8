"""Speculative decoding with an EAGLE-3 head on the GPU path, one batch of requests.

One step (Leviathan et al., arXiv 2211.17192; EAGLE-3, arXiv 2503.01840; the step order
of vLLM's GPU model runner with its padded EAGLE drafter):

1. verification: the target runs ``[last token, d_1 .. d_k]`` per request (``k + 1``
   tokens, :func:`~specula.runtime.kernels.paged_attention.paged_verify_attention`,
   a CUDA graph per descriptor) and returns its auxiliary hidden states;
2. rejection sampling (:func:`~specula.runtime.kernels.rejection_sampler.rejection_sample`,
   greedy), or a caller-given number of accepted tokens per request (*synthetic
   acceptance*, as vLLM's synthetic rejection-sampler mode, for benchmarks): the
   emitted tokens are the accepted drafts and the target's token at the first
   rejected (or bonus) position;
3. KV bookkeeping: each request's blocks are truncated to its accepted length, then
   the slots of the next verification are appended;
4. the draft's prefill over the verified slots (reusing the verification's attention
   state) and its ``k - 1`` decode steps propose the next ``k`` tokens.

With synthetic acceptance the host knows every count in advance, so a step never waits
for the device; with real rejection the host reads the accepted counts once per step.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence

import torch

from specula.runtime.gpu.block_manager import BlockManager
from specula.runtime.gpu.cudagraph import CUDAGraphManager
from specula.runtime.gpu.draft_graphs import (
    DraftBuffers,
    DraftDecodeGraphManager,
    DraftPrefillGraphManager,
    draft_decode,
    draft_prefill,
    set_decode_metadata,
)
from specula.runtime.gpu.eagle3_runner import GPUEagle3Runner
from specula.runtime.gpu.model_runner import GPUModelRunner
from specula.runtime.gpu.paged_kv import metadata_from_block_manager
from specula.runtime.kernels.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample


def synthetic_num_accepted(
    rng: random.Random, acceptance_rate: float, num_speculative_tokens: int, num_reqs: int
) -> list[int]:
    """Accepted-prefix lengths with a fixed per-position acceptance rate: position ``i``
    is accepted with probability ``acceptance_rate`` given that all earlier ones were
    (vLLM's synthetic rejection mode); ``E[accepted + 1] = sum_{i=0..k} a^i``.

    Returns:
        ``num_reqs`` counts in ``[0, num_speculative_tokens]``.
    """
    out = []
    for _ in range(num_reqs):
        n = 0
        while n < num_speculative_tokens and rng.random() < acceptance_rate:
            n += 1
        out.append(n)
    return out


class GPUEagle3SpecDecoder:
    """Greedy EAGLE-3 speculative decoding of one batch on the GPU runners.

    Args:
        target: the target runner; ``target.kv_cache`` and ``draft.kv_cache`` have the
            same blocks, both indexed through ``manager``.
        draft: the EAGLE-3 head's runner.
        manager: block manager of the shared block tables.
        aux_layer_ids: the head's ``aux_hidden_state_layer_ids``.
        max_num_reqs: most requests per batch.
        num_speculative_tokens: every ``k`` to prepare graphs for.
        use_cuda_graphs: capture (call :meth:`capture`) and replay; else all eager.
        capture_sizes: request counts to capture (default: the target's ladder).
        reuse_target_state: the draft prefill reads the verification's captured
            attention state (True) or rebuilds its metadata (False).
    """

    def __init__(
        self,
        target: GPUModelRunner,
        draft: GPUEagle3Runner,
        manager: BlockManager,
        aux_layer_ids: Sequence[int],
        max_num_reqs: int,
        num_speculative_tokens: Sequence[int],
        *,
        use_cuda_graphs: bool = True,
        capture_sizes: Sequence[int] | None = None,
        reuse_target_state: bool = True,
    ) -> None:
        ks = sorted(set(num_speculative_tokens))
        if ks[0] < 1:
            raise ValueError(f"num_speculative_tokens {ks} must be >= 1")
        self.target, self.draft, self.manager = target, draft, manager
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.device = target.device
        self.buffers = DraftBuffers(draft, max_num_reqs, ks[-1])
        self.use_cuda_graphs = use_cuda_graphs
        self.target_graphs = self.prefill_graphs = self.decode_graphs = None
        if use_cuda_graphs:
            self.target_graphs = CUDAGraphManager(
                target, max_num_reqs, [k + 1 for k in ks], capture_sizes, self.aux_layer_ids
            )
            self.prefill_graphs = DraftPrefillGraphManager(
                draft, self.buffers, self.target_graphs, reuse_target_state
            )
            self.decode_graphs = DraftDecodeGraphManager(
                draft, self.buffers, self.target_graphs.capture_sizes, [k - 1 for k in ks]
            )
        self.request_ids: list[Hashable] = []
        self.k = 0
        self._verify = None  # (metadata, positions) of the next verification

    @torch.no_grad()
    def capture(self) -> None:
        """Capture the target's verification graphs, then the draft's graphs."""
        assert self.use_cuda_graphs
        self.target_graphs.capture()
        self.prefill_graphs.capture()
        self.decode_graphs.capture()

    def _propose_rest(self) -> None:
        """Append the next verification's slots and run the draft decode steps."""
        k, r = self.k, len(self.request_ids)
        for req in self.request_ids:
            self.manager.append_slots(req, k + 1)
        self._verify = metadata_from_block_manager(
            self.manager,
            self.request_ids,
            [k + 1] * r,
            self.target.max_blocks_per_req,
            self.device,
        )
        metadata, positions = self._verify
        if self.decode_graphs is None:
            set_decode_metadata(self.buffers, metadata, positions, k)
            draft_decode(self.draft, self.buffers, r, k - 1)
        else:
            set_decode_metadata(
                self.buffers, metadata, positions, k, self.decode_graphs.padded_num_reqs(r)
            )
            self.decode_graphs.run(r, k - 1)

    @torch.no_grad()
    def start(
        self, request_ids: Sequence[Hashable], prompts: torch.Tensor, num_speculative_tokens: int
    ) -> torch.Tensor:
        """Prefill equal-length prompts in the target and the draft, then draft the
        first ``k`` tokens.

        Args:
            request_ids: new request ids (blocks are allocated here).
            prompts: [num_reqs, prompt_len] int64 on the device.
            num_speculative_tokens: ``k`` for this batch.

        Returns:
            [num_reqs] int64, the first generated token of each request.

        Raises:
            ValueError: ``k`` larger than the buffers', or more requests than
                ``max_num_reqs``.
        """
        r, prompt_len = prompts.shape
        k = num_speculative_tokens
        if not 1 <= k <= self.buffers.max_k or r > self.buffers.max_num_reqs:
            raise ValueError(f"k={k} or {r} requests outside the buffers' sizes")
        self.request_ids, self.k = list(request_ids), k
        for req in self.request_ids:
            self.manager.allocate(req, prompt_len)
        metadata, positions = metadata_from_block_manager(
            self.manager,
            self.request_ids,
            [prompt_len] * r,
            self.target.max_blocks_per_req,
            self.device,
        )
        input_ids = prompts.reshape(-1)
        hidden, aux = self.target.forward(input_ids, positions, metadata, self.aux_layer_ids)
        last = self.target.last_token_indices(metadata)
        first = self.target.compute_logits(hidden[last]).argmax(-1)  # [r]
        self.buffers.next_token_ids[:r] = first
        # Zero everywhere, padding rows included: a count left over from a batch with
        # a larger k would point a padded graph row outside its request's slots.
        self.buffers.num_accepted.zero_()
        draft_prefill(self.draft, self.buffers, metadata, input_ids, positions, aux, 0)
        self._propose_rest()
        return first

    @torch.no_grad()
    def step(self, num_accepted: Sequence[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """One speculative step over the batch.

        Args:
            num_accepted: synthetic accepted counts per request (each in ``[0, k]``),
                overriding the rejection sampler's; ``None`` for real greedy rejection
                sampling (the host then waits for the counts).

        Returns:
            ``(output_token_ids [num_reqs, k + 1] int64 on the device, accepted counts
            on the host)``: row ``i`` holds its accepted drafts, the target's token at
            the first rejected (or bonus) position, then ``PLACEHOLDER_TOKEN_ID``.
        """
        k, r = self.k, len(self.request_ids)
        buf = self.buffers
        metadata, positions = self._verify
        drafts = buf.draft_token_ids[:r, :k]  # [r, k]
        verify_ids = torch.cat([buf.next_token_ids[:r, None], drafts], dim=1).view(-1)
        d = None
        if self.target_graphs is not None:
            d = self.target_graphs.descriptor_for(r, k + 1)
            hidden, aux = self.target_graphs.run_with_aux(verify_ids, positions, metadata)
        else:
            hidden, aux = self.target.forward(verify_ids, positions, metadata, self.aux_layer_ids)
        target_argmax = self.target.compute_logits(hidden).argmax(-1)  # [r * (k + 1)]
        output, accepted = rejection_sample(
            drafts.contiguous().view(-1), buf.cu_num_draft_tokens[k][:r], target_argmax, k
        )
        if num_accepted is not None:
            assert len(num_accepted) == r and all(0 <= a <= k for a in num_accepted)
            pin = self.device.type == "cuda"
            accepted = torch.tensor(num_accepted, dtype=torch.int64, pin_memory=pin).to(
                self.device, non_blocking=pin
            )
            cols = torch.arange(k + 1, device=self.device)
            bonus = target_argmax.view(r, k + 1).gather(1, accepted[:, None])  # [r, 1]
            padded = torch.cat([drafts, drafts[:, :1]], dim=1)
            output = torch.where(
                cols < accepted[:, None],
                padded,
                torch.where(cols == accepted[:, None], bonus, PLACEHOLDER_TOKEN_ID),
            )
            host_accepted = list(num_accepted)
        else:
            host_accepted = accepted.tolist()
        buf.num_accepted[:r] = accepted
        buf.next_token_ids[:r] = target_argmax.view(r, k + 1).gather(1, accepted[:, None])[:, 0]
        # The prefill without reuse rebuilds the verification's metadata from these.
        tables = seq_lens = None
        if self.prefill_graphs is not None and not self.prefill_graphs.reuse_target_state:
            tables = [self.manager.block_table(req) for req in self.request_ids]
            seq_lens = [self.manager.num_tokens(req) for req in self.request_ids]
        for req, a in zip(self.request_ids, host_accepted, strict=True):
            # The verification wrote k + 1 slots; keep the last emitted token and the
            # accepted drafts (the newly sampled token is written by the next one).
            self.manager.truncate(req, self.manager.num_tokens(req) - k + a)
        if d is not None and d in self.prefill_graphs.graphs:
            self.prefill_graphs.run(d, tables, seq_lens)
        else:
            draft_prefill(self.draft, buf, metadata, verify_ids, positions, aux, k)
        self._propose_rest()
        return output, host_accepted

    def finish(self) -> None:
        """Free the batch's KV blocks."""
        for req in self.request_ids:
            self.manager.free(req)
        self.request_ids = []
        self._verify = None
