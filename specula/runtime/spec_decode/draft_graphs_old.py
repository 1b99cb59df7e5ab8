"""The EAGLE-3 draft's two forwards per speculative step, eager and in CUDA graphs.

After a verification forward of ``k + 1`` tokens per request the draft runs

- a *prefill* over the same token slots (:func:`draft_prefill`): inputs shifted left by
  one with the sampled token at each request's last accepted slot
  (:func:`~specula.runtime.kernels.draft_inputs.prepare_draft_inputs`), conditioned on
  ``fc`` of the target's auxiliary hidden states; it yields the first draft token;
- ``k - 1`` one-token *decode* steps (:func:`draft_decode`), each conditioned on the
  previous step's output state, at the positions of the next verification's first
  ``k - 1`` slots.

Prefill graphs (:class:`DraftPrefillGraphManager`) are keyed by the target's
verification :class:`~specula.runtime.worker.cudagraph.BatchExecutionDescriptor`. With
``reuse_target_state`` they read the target graph's
:class:`~specula.runtime.worker.cudagraph.CapturedAttentionState` (slot mapping, block
table, sequence lengths, positions, input ids) and its auxiliary-state output buffer
directly, so after the target's replay nothing is built or copied (vLLM Model Runner V2,
PR #40410); without it they own their metadata buffers, which are rebuilt on the host
and copied in before every replay (the ablation). Decode graphs
(:class:`DraftDecodeGraphManager`) own their metadata, keyed by ``(num_reqs,
num_steps)``; all ``k - 1`` steps are one graph. Nothing here copies device data to the
host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specula.runtime.kernels.draft_inputs import prepare_draft_inputs
from specula.runtime.spec_decode.eagle.runner import Eagle3Runner
from specula.runtime.worker.cudagraph import BatchExecutionDescriptor, CUDAGraphManager
from specula.runtime.worker.paged_kv import PagedAttentionMetadata, build_attention_metadata


class DraftBuffers:
    """Static device state shared by the draft's forwards and the verifier, sized for
    ``max_num_reqs`` requests and ``max_num_speculative_tokens`` draft tokens.

    Args:
        draft: the draft runner (device, dtype, width, block-table width).
        max_num_reqs: most requests in one step.
        max_num_speculative_tokens: largest ``k``.
    """

    def __init__(
        self, draft: Eagle3Runner, max_num_reqs: int, max_num_speculative_tokens: int
    ) -> None:
        r, k = max_num_reqs, max_num_speculative_tokens
        device, hidden = draft.device, draft.config.hidden_size
        self.max_num_reqs, self.max_k = r, k
        i64 = dict(dtype=torch.int64, device=device)
        self.num_accepted = torch.zeros(r, **i64)
        """[max_num_reqs] accepted draft tokens of the last verification."""
        self.next_token_ids = torch.zeros(r, **i64)
        """[max_num_reqs] the last sampled (bonus or recovered) token."""
        self.draft_token_ids = torch.zeros(r, k, **i64)
        """[max_num_reqs, k] the drafts of the next verification (target ids)."""
        self.draft_hidden = torch.zeros(r, hidden, dtype=draft.dtype, device=device)
        """[max_num_reqs, H] the state the next draft step reads."""
        self.draft_input_ids = torch.zeros(r * (k + 1), **i64)
        self.draft_positions = torch.zeros(r * (k + 1), **i64)
        self.last_token_indices = torch.zeros(r, **i64)
        self.cu_num_draft_tokens = {
            j: torch.arange(1, r + 1, dtype=torch.int32, device=device) * j for j in range(k + 1)
        }
        """``j`` -> [max_num_reqs] int32 inclusive cumulative counts of ``j`` drafts each."""
        # Decode-step metadata, [step, request].
        self.positions = torch.zeros(k, r, **i64)
        self.slot_mapping = torch.full((k, r), -1, **i64)
        self.seq_lens = torch.zeros(k, r, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(
            r, draft.max_blocks_per_req, dtype=torch.int32, device=device
        )
        self.query_start_loc = torch.arange(r + 1, dtype=torch.int32, device=device)


def draft_prefill(
    draft: Eagle3Runner,
    buffers: DraftBuffers,
    metadata: PagedAttentionMetadata,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    aux_hidden_states: torch.Tensor,
    num_draft_tokens: int | torch.Tensor,
) -> None:
    """The draft's forward over the slots of the target forward it follows; writes the
    first draft token to ``buffers.draft_token_ids[:, 0]`` and its output state to
    ``buffers.draft_hidden``.

    Args:
        draft: the draft runner.
        buffers: reads ``num_accepted`` and ``next_token_ids`` (set by the verifier).
        metadata: the target forward's metadata (its slots and block tables).
        input_ids, positions: [num_tokens] the target forward's inputs.
        aux_hidden_states: [num_tokens, num_aux * H_target] from that forward.
        num_draft_tokens: drafts per request verified by that forward (0 after a
            prompt prefill, else ``k``), or, when requests differ (a mixed batch of
            verifications and prefills), their inclusive cumulative counts
            ``[num_reqs]`` int32.
    """
    r, n = metadata.num_reqs, metadata.num_tokens
    # A verification batch fits the static buffers (CUDA graphs need fixed addresses);
    # a prompt prefill allocates.
    static = n <= buffers.draft_input_ids.shape[0]
    ids, pos, last = prepare_draft_inputs(
        input_ids,
        positions,
        metadata.query_start_loc,
        (
            buffers.cu_num_draft_tokens[num_draft_tokens][:r]
            if isinstance(num_draft_tokens, int)
            else num_draft_tokens
        ),
        buffers.num_accepted[:r],
        buffers.next_token_ids[:r],
        out_input_ids=buffers.draft_input_ids[:n] if static else None,
        out_positions=buffers.draft_positions[:n] if static else None,
        out_last_token_indices=buffers.last_token_indices[:r],
    )
    hidden_in = draft.combine_hidden_states(aux_hidden_states)  # [n, H]
    normed, next_hidden = draft.forward(ids, pos, metadata, hidden_in)
    buffers.draft_token_ids[:r, 0] = draft.draft_token_ids(normed[last])  # [r]
    buffers.draft_hidden[:r] = next_hidden[last]


def set_decode_metadata(
    buffers: DraftBuffers,
    verify_metadata: PagedAttentionMetadata,
    verify_positions: torch.Tensor,
    num_speculative_tokens: int,
    padded_num_reqs: int | None = None,
) -> None:
    """Write the decode steps' metadata from the *next* verification's: step ``i`` of
    request ``j`` sits at that verification's slot ``i`` (the draft writes its keys
    where the target will verify), context ``position + 1``. Device copies only.

    Args:
        buffers: receives ``positions``, ``slot_mapping``, ``seq_lens``, ``block_table``.
        verify_metadata, verify_positions: of ``num_reqs`` requests of ``k + 1`` tokens.
        num_speculative_tokens: ``k``; ``k - 1`` steps are written.
        padded_num_reqs: the graph's request count; rows up to it become padding
            (slot -1, context 0).
    """
    r, k = verify_metadata.num_reqs, num_speculative_tokens
    steps = k - 1
    assert verify_metadata.num_tokens == r * (k + 1)
    if steps <= 0:
        return
    pos = verify_positions.view(r, k + 1)[:, :steps].t()  # [steps, r]
    buffers.positions[:steps, :r].copy_(pos)
    buffers.seq_lens[:steps, :r].copy_(pos + 1)
    buffers.slot_mapping[:steps, :r].copy_(
        verify_metadata.slot_mapping.view(r, k + 1)[:, :steps].t()
    )
    buffers.block_table[:r].copy_(verify_metadata.block_table)
    if padded_num_reqs is not None and padded_num_reqs > r:
        buffers.slot_mapping[:steps, r:padded_num_reqs].fill_(-1)
        buffers.seq_lens[:steps, r:padded_num_reqs].zero_()


def draft_decode(
    draft: Eagle3Runner, buffers: DraftBuffers, num_reqs: int, num_steps: int
) -> None:
    """``num_steps`` one-token draft steps on the metadata of :func:`set_decode_metadata`:
    step ``i`` reads ``draft_token_ids[:, i]`` and ``draft_hidden``, writes
    ``draft_token_ids[:, i + 1]`` and the new ``draft_hidden``."""
    r = num_reqs
    for i in range(num_steps):
        metadata = PagedAttentionMetadata(
            slot_mapping=buffers.slot_mapping[i, :r],
            block_table=buffers.block_table[:r],
            seq_lens=buffers.seq_lens[i, :r],
            query_start_loc=buffers.query_start_loc[: r + 1],
            num_reqs=r,
            num_tokens=r,
            uniform_query_len=1,
            prefill=False,
            query_lens_cpu=(1,) * r,
        )
        normed, next_hidden = draft.forward(
            buffers.draft_token_ids[:r, i],
            buffers.positions[i, :r],
            metadata,
            buffers.draft_hidden[:r],
        )
        buffers.draft_token_ids[:r, i + 1] = draft.draft_token_ids(normed)
        buffers.draft_hidden[:r] = next_hidden


def _capture(fn, pool) -> torch.cuda.CUDAGraph:
    # Warm-up on a side stream (Triton compilation, cuBLAS heuristics), then capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph


class DraftPrefillGraphManager:
    """Draft prefill graphs, one per verification descriptor of the target's graphs.

    Args:
        draft, buffers: the draft runner and its static state.
        target_graphs: the target's captured graphs (``aux_layer_ids`` set); descriptors
            with ``uniform_query_len >= 2`` are verification shapes.
        reuse_target_state: read the target's :class:`CapturedAttentionState` (True) or
            own metadata buffers refilled from the host at each replay (False).
    """

    def __init__(
        self,
        draft: Eagle3Runner,
        buffers: DraftBuffers,
        target_graphs: CUDAGraphManager,
        reuse_target_state: bool = True,
    ) -> None:
        if not target_graphs.aux_layer_ids:
            raise ValueError("the target graphs must return auxiliary hidden states")
        self.draft, self.buffers, self.target_graphs = draft, buffers, target_graphs
        self.reuse_target_state = reuse_target_state
        self.pool: tuple | None = None
        self.graphs: dict[BatchExecutionDescriptor, torch.cuda.CUDAGraph] = {}
        self.own_metadata: dict[BatchExecutionDescriptor, tuple] = {}
        if not reuse_target_state:
            src = target_graphs
            self.positions = torch.zeros_like(src.positions)
            self.slot_mapping = torch.full_like(src.slot_mapping, -1)
            self.block_table = torch.zeros_like(src.block_table)
            self.seq_lens = torch.zeros_like(src.seq_lens)

    def _inputs(self, d: BatchExecutionDescriptor):
        state = self.target_graphs.states[d]
        aux = self.target_graphs.aux_outputs[d]
        if self.reuse_target_state:
            return state.metadata, state.input_ids, state.positions, aux
        n, r = d.num_tokens, d.num_reqs
        m = state.metadata
        metadata = PagedAttentionMetadata(
            slot_mapping=self.slot_mapping[:n],
            block_table=self.block_table[:r],
            seq_lens=self.seq_lens[:r],
            query_start_loc=m.query_start_loc,
            num_reqs=r,
            num_tokens=n,
            uniform_query_len=d.uniform_query_len,
            prefill=False,
            query_lens_cpu=m.query_lens_cpu,
        )
        return metadata, state.input_ids, self.positions[:n], aux

    @torch.no_grad()
    def capture(self, descriptors: Sequence[BatchExecutionDescriptor] | None = None) -> None:
        """Capture one graph per verification descriptor of ``target_graphs`` (which
        must already be captured; default: all of them), largest first, in one pool."""
        if descriptors is None:
            descriptors = [d for d in self.target_graphs.descriptors() if d.uniform_query_len >= 2]
        for d in descriptors:
            args = self._inputs(d)
            k = d.uniform_query_len - 1
            graph = _capture(
                lambda args=args, k=k: draft_prefill(self.draft, self.buffers, *args, k),
                self.pool,
            )
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[d] = graph
        torch.cuda.synchronize()

    @torch.no_grad()
    def run(
        self,
        d: BatchExecutionDescriptor,
        block_tables: Sequence[Sequence[int]] | None = None,
        seq_lens: Sequence[int] | None = None,
    ) -> None:
        """Replay the prefill of descriptor ``d`` right after the target's replay of
        ``d``. Without reuse, ``block_tables`` and ``seq_lens`` (the verification's, per
        real request) are turned into metadata on the host and copied in first.

        Raises:
            KeyError: ``d`` was not captured.
        """
        if not self.reuse_target_state:
            assert block_tables is not None and seq_lens is not None
            q = d.uniform_query_len
            metadata, positions = build_attention_metadata(
                block_tables,
                seq_lens,
                [q] * len(seq_lens),
                self.draft.block_size,
                self.draft.max_blocks_per_req,
                self.draft.device,
            )
            n, r = metadata.num_tokens, metadata.num_reqs
            self.positions[:n].copy_(positions)
            self.slot_mapping[:n].copy_(metadata.slot_mapping)
            self.block_table[:r].copy_(metadata.block_table)
            self.seq_lens[:r].copy_(metadata.seq_lens)
            if d.num_reqs > r:
                self.slot_mapping[n : d.num_tokens].fill_(-1)
                self.seq_lens[r : d.num_reqs].zero_()
        self.graphs[d].replay()


class DraftDecodeGraphManager:
    """Graphs of the ``k - 1`` draft decode steps, keyed by ``(num_reqs, num_steps)``,
    on the decode metadata in :class:`DraftBuffers` (:func:`set_decode_metadata`).

    Args:
        draft, buffers: the draft runner and its static state.
        capture_sizes: request counts (ascending); a batch pads to the next one.
        num_steps: step counts to capture (``k - 1`` for each ``k`` in use, >= 1).
    """

    def __init__(
        self,
        draft: Eagle3Runner,
        buffers: DraftBuffers,
        capture_sizes: Sequence[int],
        num_steps: Sequence[int],
    ) -> None:
        self.draft, self.buffers = draft, buffers
        self.capture_sizes = sorted(set(capture_sizes))
        self.num_steps = sorted({s for s in num_steps if s >= 1})
        self.pool: tuple | None = None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def padded_num_reqs(self, num_reqs: int) -> int | None:
        """The captured request count a batch pads to, or ``None`` (run eagerly)."""
        return next((r for r in self.capture_sizes if r >= num_reqs), None)

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every ``(num_reqs, num_steps)``, largest first, in one pool."""
        self.buffers.slot_mapping.fill_(-1)
        self.buffers.seq_lens.zero_()
        keys = sorted(
            ((r, s) for r in self.capture_sizes for s in self.num_steps),
            key=lambda key: (key[0] * key[1], key[0]),
            reverse=True,
        )
        for r, s in keys:
            graph = _capture(
                lambda r=r, s=s: draft_decode(self.draft, self.buffers, r, s), self.pool
            )
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[(r, s)] = graph
        torch.cuda.synchronize()

    @torch.no_grad()
    def run(self, num_reqs: int, num_steps: int) -> None:
        """Run the decode steps (metadata already set): replay when captured, else
        eager."""
        if num_steps <= 0:
            return
        padded = self.padded_num_reqs(num_reqs)
        graph = self.graphs.get((padded, num_steps)) if padded is not None else None
        if graph is None:
            draft_decode(self.draft, self.buffers, num_reqs, num_steps)
        else:
            graph.replay()
