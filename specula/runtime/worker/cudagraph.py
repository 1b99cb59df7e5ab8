"""CUDA graphs of the target's decode and verification forwards.

A batch is described by a :class:`BatchExecutionDescriptor` (tokens, requests, uniform query
length: 1 for decode, ``k + 1`` for verification). One graph is captured per descriptor, for the
request counts of :func:`cudagraph_capture_sizes`, into one memory pool, largest first (so
smaller graphs reuse the largest one's blocks), on static input buffers sized for the largest
batch. At replay a batch is padded to the next captured request count (padding requests:
``seq_lens`` 0, ``slot_mapping`` -1, so they neither read nor write the cache); a batch with no
captured size (prefill, mixed query lengths, more requests than captured) runs eagerly.

Each capture returns a :class:`CapturedAttentionState`: the attention metadata, slot mapping and
position buffers that graph reads. Keeping them by descriptor lets a speculator's prefill graphs
reuse the target's metadata instead of rebuilding it (vLLM Model Runner V2, PR #40410). Design
after vLLM's ``cudagraph_utils.py`` and nano-vllm's ``capture_cudagraph``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specula.runtime.worker.model_runner import ModelRunner
from specula.runtime.worker.paged_kv import PagedAttentionMetadata


@dataclass(frozen=True)
class BatchExecutionDescriptor:
    """The launch shape of one forward: what a CUDA graph is keyed by."""

    num_tokens: int
    num_reqs: int
    uniform_query_len: int
    """Query tokens per request: 1 for decode, ``k + 1`` for verification."""


@dataclass
class CapturedAttentionState:
    """The device buffers a captured graph reads, views of the manager's static buffers
    sized for its descriptor; writing a batch into them and replaying runs that batch."""

    descriptor: BatchExecutionDescriptor
    metadata: PagedAttentionMetadata
    """``slot_mapping [num_tokens]``, ``block_table [num_reqs, max_blocks_per_req]``,
    ``seq_lens [num_reqs]``, ``query_start_loc [num_reqs + 1]`` (constant: uniform)."""
    input_ids: torch.Tensor
    """[num_tokens] int64."""
    positions: torch.Tensor
    """[num_tokens] int64."""
    hidden_states: torch.Tensor | None = None
    """[num_tokens, hidden_size] the graph's output buffer (set once captured)."""
    aux_hidden_states: torch.Tensor | None = None
    """[num_tokens, len(aux_layer_ids) * hidden_size] its auxiliary output, if any."""


def capture_graph(fn, pool: tuple | None) -> torch.cuda.CUDAGraph:
    """Capture ``fn()`` into a graph in memory pool ``pool`` after one warm-up call on a
    side stream, as ``torch.cuda.graph``'s documentation asks (the warm-up compiles the
    Triton kernels of the launch shape and lets cuBLAS pick its algorithms)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    _captured.add(graph)
    return graph


_captured: weakref.WeakSet[torch.cuda.CUDAGraph] = weakref.WeakSet()


def release_graphs() -> None:
    """Free every graph :func:`capture_graph` made that is still alive; they cannot be
    replayed after. A group's NCCL communicator cannot be destroyed while a graph holds
    its collectives (``ncclCommDestroy`` waits for them: pytorch/pytorch#115388), so a
    tensor-parallel rank calls this before it leaves the group."""
    if _captured:
        torch.cuda.synchronize()
    for graph in list(_captured):
        graph.reset()
    _captured.clear()


def padded_size(capture_sizes: Sequence[int], num_reqs: int) -> int | None:
    """The smallest of the ascending ``capture_sizes`` that holds ``num_reqs`` requests,
    or ``None`` (too many: run eagerly)."""
    return next((r for r in capture_sizes if r >= num_reqs), None)


def cudagraph_capture_sizes(max_num_reqs: int) -> list[int]:
    """Request counts to capture: 1, 2, 4, 8, then every multiple of 8 up to
    ``max_num_reqs``, and ``max_num_reqs`` itself (vLLM's default ladder); ascending.

    Raises:
        ValueError: ``max_num_reqs`` < 1.
    """
    if max_num_reqs < 1:
        raise ValueError(f"max_num_reqs={max_num_reqs} must be >= 1")
    sizes = {1, 2, 4, 8, *range(16, max_num_reqs + 1, 8), max_num_reqs}
    return sorted(s for s in sizes if s <= max_num_reqs)


class CUDAGraphManager:
    """Captures and replays the runner's forward per :class:`BatchExecutionDescriptor`.

    Args:
        runner: the eager forward to capture.
        max_num_reqs: most requests in one forward.
        uniform_query_lens: query lengths to capture (1 for decode; add ``k + 1`` for
            each verification width in use).
        capture_sizes: request counts to capture; default
            :func:`cudagraph_capture_sizes` of ``max_num_reqs``.
        aux_layer_ids: residual streams the graphs also return (EAGLE-3's auxiliary hidden states,
            see :meth:`ModelRunner.forward`); read them with :meth:`run`.

    Raises:
        ValueError: a capture size outside ``[1, max_num_reqs]`` or a query length < 1.
    """

    def __init__(
        self, runner: ModelRunner, max_num_reqs: int, uniform_query_lens: Sequence[int] = (1,),
        capture_sizes: Sequence[int] | None = None, aux_layer_ids: Sequence[int] = (),
    ) -> None:
        sizes = sorted(set(capture_sizes or cudagraph_capture_sizes(max_num_reqs)))
        if sizes[0] < 1 or sizes[-1] > max_num_reqs:
            raise ValueError(f"capture sizes {sizes} outside [1, {max_num_reqs}]")
        if min(uniform_query_lens) < 1:
            raise ValueError(f"uniform_query_lens {uniform_query_lens} must be >= 1")
        self.runner = runner
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.capture_sizes = sizes
        self.uniform_query_lens = tuple(sorted(set(uniform_query_lens)))
        device = runner.device
        max_tokens = max_num_reqs * max(self.uniform_query_lens)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(
            max_num_reqs, runner.max_blocks_per_req, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.query_start_loc = {
            q: torch.arange(max_num_reqs + 1, dtype=torch.int32, device=device) * q
            for q in self.uniform_query_lens}
        self.pool: tuple | None = None
        self.graphs: dict[BatchExecutionDescriptor, torch.cuda.CUDAGraph] = {}
        self.states: dict[BatchExecutionDescriptor, CapturedAttentionState] = {}
        self.num_replays = 0
        """Graph replays since capture (a counter)."""

    def descriptors(self) -> list[BatchExecutionDescriptor]:
        """Every descriptor to capture, largest first."""
        out = [BatchExecutionDescriptor(r * q, r, q)
               for q in self.uniform_query_lens for r in self.capture_sizes]
        return sorted(out, key=lambda d: (d.num_tokens, d.num_reqs), reverse=True)

    @torch.no_grad()
    def capture(self) -> dict[BatchExecutionDescriptor, CapturedAttentionState]:
        """Capture every descriptor (largest first, one pool).

        Returns:
            the captured attention states by descriptor (also kept in ``self.states``).

        Raises:
            RuntimeError: the runner is not on a CUDA device.
        """
        if self.runner.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the runner on a CUDA device")
        # Padding values everywhere: the warm-up forwards then neither read nor write the KV cache.
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        for d in self.descriptors():
            n, r, q = d.num_tokens, d.num_reqs, d.uniform_query_len
            metadata = PagedAttentionMetadata.from_query_lens(
                self.slot_mapping[:n], self.block_table[:r], self.seq_lens[:r],
                self.query_start_loc[q][: r + 1], (q,) * r)
            state = CapturedAttentionState(d, metadata, self.input_ids[:n], self.positions[:n])
            outputs: list = []
            args = (state.input_ids, state.positions, metadata, self.aux_layer_ids)
            graph = capture_graph(lambda a=args, out=outputs: out.append(self.runner.forward(*a)),
                                  self.pool)
            self.pool = graph.pool()
            self.graphs[d] = graph
            # The outputs of the captured call (the warm-up's come first).
            state.hidden_states, state.aux_hidden_states = outputs[-1]
            self.states[d] = state
        torch.cuda.synchronize()
        return dict(self.states)

    def descriptor_for(self, num_reqs: int,
                       uniform_query_len: int | None) -> BatchExecutionDescriptor | None:
        """The captured descriptor a batch pads to, or ``None`` (run eagerly)."""
        r = padded_size(self.capture_sizes, num_reqs)
        if r is None or uniform_query_len is None:
            return None
        d = BatchExecutionDescriptor(r * uniform_query_len, r, uniform_query_len)
        return d if d in self.graphs else None

    @torch.no_grad()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: PagedAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None, BatchExecutionDescriptor | None]:
        """The forward of a batch: graph replay when a captured size fits, else eager.

        Args:
            input_ids, positions: [num_tokens] int64.
            metadata: the batch's metadata (``block_table`` ``max_blocks_per_req`` wide).

        Returns:
            ``(hidden [num_tokens, hidden_size], aux [num_tokens, len(aux_layer_ids) *
            hidden_size] or None, the descriptor replayed or None)``. After a replay the
            tensors are views of the graph's output buffers, valid until the next replay
            of any graph, and the descriptor's :attr:`states` entry holds the batch
            (padded), for draft graphs that reuse it.
        """
        d = (self.descriptor_for(metadata.num_reqs, metadata.uniform_query_len)
             if not metadata.prefill and metadata.split is None else None)
        if d is None:
            return *self.runner.forward(input_ids, positions, metadata, self.aux_layer_ids), None
        n, r = metadata.num_tokens, metadata.num_reqs
        assert metadata.block_table.shape[1] == self.block_table.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.seq_lens[:r].copy_(metadata.seq_lens)
        self.block_table[:r].copy_(metadata.block_table)
        if d.num_reqs > r:
            self.slot_mapping[n : d.num_tokens].fill_(-1)
            self.seq_lens[r : d.num_reqs].zero_()
            self.positions[n : d.num_tokens].zero_()
        self.graphs[d].replay()
        self.num_replays += 1
        state = self.states[d]
        aux = state.aux_hidden_states
        return state.hidden_states[:n], None if aux is None else aux[:n], d
